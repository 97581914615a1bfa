"""Regenerate the sample ONNX models used to exercise lnfuse.

Makes six tiny, randomly initialised transformer models with PyTorch and
exports them to ONNX next to this file:

* ``bert_tiny_legacy_op14.onnx``       BERT-style post-norm encoder, nn.LayerNorm,
                                        TorchScript (legacy) exporter, opset 14.
* ``bert_tiny_dynamo_op18.onnx``       same encoder with hand-written LayerNorm
                                        (old HuggingFace style), dynamo exporter, opset 18.
* ``llama_tiny_legacy_op14.onnx``      LLaMA-style pre-norm decoder with HF-style
                                        RMSNorm, legacy exporter, opset 14.
* ``llama_tiny_dynamo_op18.onnx``      same decoder, dynamo exporter, opset 18.
* ``llama_tiny_fp16_legacy_op17.onnx`` the decoder in float16, legacy exporter, opset 17.
* ``bert_tiny_fp16_legacy_op14.onnx``  the nn.LayerNorm encoder in float16, legacy, opset 14.

Every norm gets random (not 1/0) weights and biases so that a wrong fusion shows
up numerically. All models are seeded, so reruns give the same weights.

torch is an *optional* dependency (the ``export`` extra): it is only needed to
regenerate these files, which are committed. Install it with
``pip install torch==2.13.0`` (CPU wheel). Other torch versions may export
different node patterns, so regenerate with the pinned one.

After exporting, each file is checked: onnx full_check, an onnxruntime run with
graph optimizations off (batch 2, sequence 5, padded attention mask), no NaN,
and agreement with torch's own output.

Run from the repo root:  ``python sample_models/make_samples.py``
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

OUT_DIR = Path(__file__).resolve().parent

# ORT 1.31 refuses models whose IR version is newer than it knows.
MAX_IR_VERSION_FOR_ORT = 10

CHECK_BATCH = 2
CHECK_SEQ = 5
# Export with a different sequence length than the check uses, so a dimension
# accidentally baked in at export time makes the check fail.
EXPORT_BATCH = 3
EXPORT_SEQ = 7


@dataclass(frozen=True)
class Config:
    vocab_size: int = 100
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    intermediate: int = 64
    max_positions: int = 64
    type_vocab_size: int = 2
    eps: float = 1e-5


# --------------------------------------------------------------------------- norms


class HandLayerNorm(nn.Module):
    """LayerNorm as older HuggingFace code wrote it (BertLayerNorm before apex)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight * x + self.bias


class LlamaRMSNorm(nn.Module):
    """RMSNorm exactly as HF LlamaRMSNorm: statistics in fp32, scale in the input dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        input_dtype = h.dtype
        h = h.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(input_dtype)


NormFactory = Callable[[int, float], nn.Module]


def torch_layer_norm(hidden: int, eps: float) -> nn.Module:
    return nn.LayerNorm(hidden, eps=eps)


# --------------------------------------------------------------------------- BERT


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, h = x.shape
    return x.view(b, s, heads, h // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, n * d)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        # A Python float, not derived from a traced shape, so tracing stays quiet.
        self.scale = math.sqrt(cfg.hidden // cfg.heads)
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.query(x), self.heads)
        k = split_heads(self.key(x), self.heads)
        v = split_heads(self.value(x), self.heads)
        scores = q @ k.transpose(-1, -2) / self.scale
        probs = torch.softmax(scores + additive_mask, dim=-1)
        return self.out(merge_heads(probs @ v))


class BertLayer(nn.Module):
    def __init__(self, cfg: Config, norm: NormFactory) -> None:
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.attention_norm = norm(cfg.hidden, cfg.eps)
        self.intermediate = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(cfg.intermediate, cfg.hidden)
        self.output_norm = norm(cfg.hidden, cfg.eps)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, additive_mask))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, cfg: Config, norm: NormFactory) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.embedding_norm = norm(cfg.hidden, cfg.eps)
        self.layers = nn.ModuleList(BertLayer(cfg, norm) for _ in range(cfg.layers))
        # A sliced buffer (as HF does) keeps position ids free of a Range op.
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_positions).unsqueeze(0), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = (
            self.word(input_ids)
            + self.position(self.position_ids[:, :seq])
            + self.token_type(token_type_ids)
        )
        x = self.embedding_norm(x)
        dtype = x.dtype
        # finfo(dtype).min keeps the fp16 variant finite (no -inf - -inf = NaN).
        additive_mask = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(
            dtype
        ).min
        for layer in self.layers:
            x = layer(x, additive_mask)
        return x


# --------------------------------------------------------------------------- LLaMA


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.scale = math.sqrt(cfg.hidden // cfg.heads)
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal_mask: torch.Tensor,
    ) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.heads)
        v = split_heads(self.v_proj(x), self.heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / self.scale
        scores = scores.masked_fill(causal_mask, torch.finfo(scores.dtype).min)
        return self.o_proj(merge_heads(torch.softmax(scores, dim=-1) @ v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden, cfg.eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal_mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, causal_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.layers))
        self.norm = LlamaRMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.max_positions).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        # Precomputed tables sliced to the sequence length, as older HF did;
        # they follow .half() like the weights.
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)
        upper = torch.ones(cfg.max_positions, cfg.max_positions, dtype=torch.bool).triu(1)
        self.register_buffer("causal_cached", upper, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        cos = self.cos_cached[:seq]
        sin = self.sin_cached[:seq]
        causal_mask = self.causal_cached[:seq, :seq]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, causal_mask)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------- building


def randomize_norms(model: nn.Module) -> None:
    """Give every norm weights away from 1 and biases away from 0.

    With identity affine parameters a fusion that drops or swaps scale/bias
    would still produce the right numbers, hiding the bug.
    """
    norm_types = (nn.LayerNorm, HandLayerNorm, LlamaRMSNorm)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, norm_types):
                continue
            module.weight.uniform_(0.5, 1.5)
            bias = getattr(module, "bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.2)


def build_bert(norm: NormFactory, seed: int = 0) -> BertEncoder:
    torch.manual_seed(seed)
    model = BertEncoder(Config(), norm)
    randomize_norms(model)
    return model.eval()


def build_llama(seed: int = 1) -> LlamaDecoder:
    torch.manual_seed(seed)
    model = LlamaDecoder(Config())
    randomize_norms(model)
    return model.eval()


# --------------------------------------------------------------------------- inputs


def bert_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cfg = Config()
    mask = np.ones((batch, seq), dtype=np.int64)
    # Trailing padding on all but the first row, so masking is exercised
    # while every row keeps at least one real token.
    for row in range(1, batch):
        mask[row, seq - row :] = 0
    token_types = np.zeros((batch, seq), dtype=np.int64)
    token_types[:, seq // 2 :] = 1
    return {
        "input_ids": rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64),
        "attention_mask": mask,
        "token_type_ids": token_types,
    }


def llama_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, Config().vocab_size, (batch, seq), dtype=np.int64)}


InputFactory = Callable[[int, int, int], dict[str, np.ndarray]]


# --------------------------------------------------------------------------- export


def export_legacy(
    model: nn.Module, inputs: dict[str, np.ndarray], output_name: str, opset: int
) -> onnx.ModelProto:
    names = list(inputs)
    dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in names + [output_name]}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy exporter is used on purpose: its decompositions are what we test.
        warnings.filterwarnings("ignore", "You are using the legacy", DeprecationWarning)
        torch.onnx.export(
            model,
            tuple(torch.from_numpy(v) for v in inputs.values()),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=names,
            output_names=[output_name],
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
    return onnx.load_from_string(buffer.getvalue())


def export_dynamo(
    model: nn.Module, inputs: dict[str, np.ndarray], output_name: str, opset: int
) -> onnx.ModelProto:
    batch = torch.export.Dim("batch")
    # The position / rotary / causal tables hold max_positions rows.
    sequence = torch.export.Dim("sequence", max=Config().max_positions)
    dynamic_shapes = {name: {0: batch, 1: sequence} for name in inputs}
    with warnings.catch_warnings():
        # Inputs share the batch/sequence Dims on purpose; the exporter warns
        # that it keeps one name per Dim, which is exactly what we want.
        warnings.filterwarnings("ignore", "# The axis name", UserWarning)
        program = torch.onnx.export(
            model,
            (),
            kwargs={name: torch.from_numpy(v) for name, v in inputs.items()},
            dynamo=True,
            opset_version=opset,
            input_names=list(inputs),
            output_names=[output_name],
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
    return program.model_proto


def strip_stack_traces(model: onnx.ModelProto) -> None:
    """Drop the dynamo exporter's per-node stack traces.

    They hold absolute source paths, which would make the saved bytes depend on
    where the checkout lives. The other node metadata (module scopes such as
    ``pkg.torch.onnx.name_scopes``) is deterministic and helps when debugging
    a fusion, so it stays.
    """
    for nodes in [model.graph.node] + [f.node for f in model.functions]:
        for node in nodes:
            kept = [p for p in node.metadata_props if "stack_trace" not in p.key]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)


def cap_ir_version(model: onnx.ModelProto) -> None:
    if model.ir_version > MAX_IR_VERSION_FOR_ORT:
        print(f"  note: exporter wrote IR {model.ir_version}; lowering to {MAX_IR_VERSION_FOR_ORT}")
        model.ir_version = MAX_IR_VERSION_FOR_ORT


@dataclass(frozen=True)
class Sample:
    file_name: str
    build: Callable[[], nn.Module]
    make_inputs: InputFactory
    output_name: str
    exporter: Callable[[nn.Module, dict[str, np.ndarray], str, int], onnx.ModelProto]
    opset: int
    fp16: bool = False


def samples() -> list[Sample]:
    return [
        Sample("bert_tiny_legacy_op14.onnx", lambda: build_bert(torch_layer_norm),
               bert_inputs, "last_hidden_state", export_legacy, 14),
        Sample("bert_tiny_dynamo_op18.onnx", lambda: build_bert(HandLayerNorm),
               bert_inputs, "last_hidden_state", export_dynamo, 18),
        Sample("llama_tiny_legacy_op14.onnx", build_llama,
               llama_inputs, "logits", export_legacy, 14),
        Sample("llama_tiny_dynamo_op18.onnx", build_llama,
               llama_inputs, "logits", export_dynamo, 18),
        Sample("llama_tiny_fp16_legacy_op17.onnx", build_llama,
               llama_inputs, "logits", export_legacy, 17, fp16=True),
        Sample("bert_tiny_fp16_legacy_op14.onnx", lambda: build_bert(torch_layer_norm),
               bert_inputs, "last_hidden_state", export_legacy, 14, fp16=True),
    ]  # fmt: skip


def torch_reference(model: nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return out.float().numpy()


def make_sample(sample: Sample) -> tuple[Path, np.ndarray]:
    """Export one sample; return its path and torch's output on the check inputs."""
    model = sample.build()
    if sample.fp16:
        # CPU has fp16 kernels for everything used here, so the trace runs in
        # real fp16 and the graph's weights/activations are float16.
        model = model.half()
    export_inputs = sample.make_inputs(EXPORT_BATCH, EXPORT_SEQ, 123)
    with torch.no_grad():
        proto = sample.exporter(model, export_inputs, sample.output_name, sample.opset)
    strip_stack_traces(proto)
    cap_ir_version(proto)
    path = OUT_DIR / sample.file_name
    onnx.save_model(proto, str(path))
    check_inputs = sample.make_inputs(CHECK_BATCH, CHECK_SEQ, 7)
    return path, torch_reference(model, check_inputs)


# --------------------------------------------------------------------------- verify


def count_ops(model: onnx.ModelProto, op_type: str) -> int:
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return sum(1 for n in nodes if n.op_type == op_type)


def run_ort(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    # Check the graph as written, not as ORT would rewrite it.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def verify(sample: Sample, path: Path, reference: np.ndarray) -> dict[str, object]:
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    inputs = sample.make_inputs(CHECK_BATCH, CHECK_SEQ, 7)
    output = run_ort(path, inputs)
    if np.isnan(output).any():
        raise AssertionError(f"{path.name}: NaN in output")
    expected_dtype = np.float16 if sample.fp16 else np.float32
    if output.dtype != expected_dtype:
        raise AssertionError(f"{path.name}: output dtype {output.dtype}, want {expected_dtype}")
    tol = 2e-2 if sample.fp16 else 1e-4
    max_err = float(np.abs(output.astype(np.float32) - reference).max())
    if max_err > tol:
        raise AssertionError(f"{path.name}: differs from torch by {max_err}")
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return {
        "file": path.name,
        "opset": opset,
        "ir": model.ir_version,
        "nodes": len(model.graph.node),
        "functions": len(model.functions),
        "ReduceMean": count_ops(model, "ReduceMean"),
        "LayerNorm": count_ops(model, "LayerNormalization"),
        "max_err": max_err,
        "kB": path.stat().st_size / 1024,
    }


def print_table(rows: list[dict[str, object]]) -> None:
    header = f"{'file':34} {'opset':>5} {'ir':>3} {'nodes':>5} {'funcs':>5} " \
             f"{'ReduceMean':>10} {'LayerNorm':>9} {'max|ort-torch|':>14} {'kB':>6}"  # fmt: skip
    print(header)
    for r in rows:
        print(
            f"{r['file']:34} {r['opset']:>5} {r['ir']:>3} {r['nodes']:>5} {r['functions']:>5} "
            f"{r['ReduceMean']:>10} {r['LayerNorm']:>9} {r['max_err']:>14.2e} {r['kB']:>6.1f}"
        )


def main() -> None:
    rows = []
    for sample in samples():
        print(f"exporting {sample.file_name}")
        path, reference = make_sample(sample)
        rows.append(verify(sample, path, reference))
    print_table(rows)


if __name__ == "__main__":
    main()
