"""Regenerate the sample ONNX models used to exercise lnfuse.

Makes ten tiny, randomly initialised transformer models with PyTorch and
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
* ``roberta_tiny_legacy_op14.onnx``    BERT encoder with RoBERTa embeddings: position ids
                                        counted from the padding mask (CumSum) inside the
                                        model, one-row token type table, nn.LayerNorm,
                                        legacy exporter, opset 14.
* ``roberta_tiny_dynamo_op18.onnx``    same with hand-written LayerNorm, dynamo exporter, opset 18.
* ``gpt2_tiny_legacy_op14.onnx``       GPT-2-style pre-norm decoder: learned positions from
                                        arange(seq) (a Range op), ln_1/ln_2 per block and a
                                        final ln_f, legacy exporter, opset 14.
* ``bert_embeddings_qdq_op14.onnx``    only BERT's embedding block + LayerNorm, exported at
                                        opset 14 and then QDQ-quantized by onnxruntime's
                                        quantize_static: uint8 tables -> DequantizeLinear -> Gather.

Every norm gets random (not 1/0) weights and biases so that a wrong fusion shows
up numerically. All models are seeded, so reruns give the same weights.

torch is an *optional* dependency (the ``export`` extra): it is only needed to
regenerate these files, which are committed. Install it with
``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``
(the CPU build; plain PyPI ``torch`` on Linux is the CUDA one). Other torch versions may export
different node patterns, so regenerate with the pinned one.

After exporting, each file is checked: onnx full_check, an onnxruntime run with
graph optimizations off (batch 2, sequence 5, padded attention mask), no NaN,
and agreement with torch's own output. For the quantized sample torch runs with
the dequantized tables the graph stores, so the check measures the graph, not
the quantization error (which is printed separately).

Run from the repo root:  ``python sample_models/make_samples.py``
"""

from __future__ import annotations

import io
import math
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)
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


# RoBERTa: token 1 is <pad>, and position ids start after it, so the table
# needs two rows more than the longest sequence (HF: max_position_embeddings = 514).
ROBERTA_PAD = 1
ROBERTA_CONFIG = Config(max_positions=64 + 2, type_vocab_size=1)


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
        additive_mask = additive_attention_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, additive_mask)
        return x


class RobertaEncoder(nn.Module):
    """The BERT encoder behind RoBERTa's embeddings (HF RobertaEmbeddings).

    Position ids and token types are computed inside the model from input_ids,
    so the graph holds the CumSum/ConstantOfShape chains an embedding fusion
    has to see through; only input_ids and attention_mask are inputs.
    """

    def __init__(self, cfg: Config, norm: NormFactory) -> None:
        super().__init__()
        self.padding_idx = ROBERTA_PAD
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden, padding_idx=ROBERTA_PAD)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden, padding_idx=ROBERTA_PAD)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.embedding_norm = norm(cfg.hidden, cfg.eps)
        self.layers = nn.ModuleList(BertLayer(cfg, norm) for _ in range(cfg.layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # HF create_position_ids_from_input_ids: real tokens count up from
        # padding_idx + 1, padding tokens stay at padding_idx.
        mask = input_ids.ne(self.padding_idx).int()
        position_ids = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.padding_idx
        # RoBERTa has one token type; HF fills the ids with zeros when none are given.
        token_type_ids = torch.zeros_like(input_ids)
        x = self.word(input_ids) + self.position(position_ids) + self.token_type(token_type_ids)
        x = self.embedding_norm(x)
        additive_mask = additive_attention_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, additive_mask)
        return x


class BertEmbeddings(nn.Module):
    """BERT's embedding block alone (HF BertEmbeddings), the input of the QDQ sample."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.embedding_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_positions).unsqueeze(0), persistent=False
        )

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = (
            self.word(input_ids)
            + self.position(self.position_ids[:, :seq])
            + self.token_type(token_type_ids)
        )
        return self.embedding_norm(x)


def additive_attention_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # finfo(dtype).min keeps the fp16 variant finite (no -inf - -inf = NaN).
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


# --------------------------------------------------------------------------- GPT-2


class Gpt2Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.hidden = cfg.hidden
        self.scale = math.sqrt(cfg.hidden // cfg.heads)
        # One fused q/k/v projection, as GPT-2's c_attn.
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden, dim=-1)
        q, k, v = (split_heads(t, self.heads) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / self.scale
        scores = scores.masked_fill(causal_mask, torch.finfo(scores.dtype).min)
        return self.c_proj(merge_heads(torch.softmax(scores, dim=-1) @ v))


class Gpt2MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, cfg.intermediate)
        # GPT-2's gelu_new is the tanh approximation (Tanh and x*x*x in the
        # graph, where BERT has Erf).
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Gpt2Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Gpt2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = Gpt2MLP(cfg)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), causal_mask)
        return x + self.mlp(self.ln_2(x))


class Gpt2Model(nn.Module):
    """GPT2Model without the LM head: its output is ln_f's."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.h = nn.ModuleList(Gpt2Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        upper = torch.ones(cfg.max_positions, cfg.max_positions, dtype=torch.bool).triu(1)
        self.register_buffer("causal_cached", upper, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        # Unlike BERT's sliced buffer, HF GPT-2 builds positions with arange,
        # which the legacy exporter writes as a Range op on the traced length.
        position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        causal_mask = self.causal_cached[:seq, :seq]
        for block in self.h:
            x = block(x, causal_mask)
        return self.ln_f(x)


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


def build_roberta(norm: NormFactory, seed: int = 2) -> RobertaEncoder:
    torch.manual_seed(seed)
    model = RobertaEncoder(ROBERTA_CONFIG, norm)
    randomize_norms(model)
    return model.eval()


def build_gpt2(seed: int = 3) -> Gpt2Model:
    torch.manual_seed(seed)
    model = Gpt2Model(Config())
    randomize_norms(model)
    return model.eval()


def build_bert_embeddings(seed: int = 4) -> BertEmbeddings:
    torch.manual_seed(seed)
    model = BertEmbeddings(Config())
    randomize_norms(model)
    return model.eval()


# --------------------------------------------------------------------------- inputs


def padded_attention_mask(batch: int, seq: int) -> np.ndarray:
    mask = np.ones((batch, seq), dtype=np.int64)
    # Trailing padding on all but the first row, so masking is exercised
    # while every row keeps at least one real token.
    for row in range(1, batch):
        mask[row, seq - row :] = 0
    return mask


def bert_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cfg = Config()
    mask = padded_attention_mask(batch, seq)
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


def roberta_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """BERT's padded mask, with <pad> ids exactly where the mask is 0.

    The model derives positions from the ids, so real tokens avoid the pad id
    and padded slots hold it; padding then gets position padding_idx as in HF.
    """
    rng = np.random.default_rng(seed)
    mask = padded_attention_mask(batch, seq)
    ids = rng.integers(ROBERTA_PAD + 1, ROBERTA_CONFIG.vocab_size, (batch, seq), dtype=np.int64)
    ids[mask == 0] = ROBERTA_PAD
    return {"input_ids": ids, "attention_mask": mask}


def embedding_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    inputs = bert_inputs(batch, seq, seed)
    return {"input_ids": inputs["input_ids"], "token_type_ids": inputs["token_type_ids"]}


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


class BatchReader(CalibrationDataReader):
    """Hands quantize_static a fixed list of input batches, then None."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def export_legacy_qdq(
    model: nn.Module, inputs: dict[str, np.ndarray], output_name: str, opset: int
) -> onnx.ModelProto:
    """Legacy export, then onnxruntime's own QDQ quantization of the Gathers.

    Done with quantize_static rather than by hand so the sample has the node
    names, initializer names and Q/DQ placement real quantized models have.
    ORT's QDQGather quantizes a Gather's float initializer data as an
    *activation* tensor, so activation_type (not weight_type) sets the table
    dtype: uint8 asymmetric, whose non-zero zero point a fusion that drops it
    gets numerically wrong. Scale and zero point come from each table's own
    min/max (per tensor, per_channel=False); the Gather output gets a Q/DQ
    pair reusing them. Only Gather is quantized: quantizing Mul/Add would also
    put activation Q/DQ pairs inside the decomposed LayerNorm, so gamma/beta
    stay float.
    """
    float_model = export_legacy(model, inputs, output_name, opset)
    # Random ids of another shape; the tables' parameters do not depend on
    # them, but quantize_static requires a calibration pass.
    calibration = [
        {name: v for name, v in bert_inputs(2, 8, seed).items() if name in inputs}
        for seed in range(100, 104)
    ]
    # quantize_static logs a hint to run quant_pre_process first; that is
    # skipped on purpose, as its ORT optimization pass would fuse the
    # LayerNorm this sample exists to leave decomposed.
    with tempfile.TemporaryDirectory() as tmp:
        float_path, qdq_path = Path(tmp) / "float.onnx", Path(tmp) / "qdq.onnx"
        onnx.save_model(float_model, str(float_path))
        quantize_static(
            str(float_path),
            str(qdq_path),
            BatchReader(calibration),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Gather"],
            per_channel=False,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        quantized = onnx.load(str(qdq_path))
    require_quantized_tables(quantized)
    return quantized


def require_quantized_tables(model: onnx.ModelProto) -> None:
    """Fail if any embedding table reaches its Gather other than through a per-tensor DQ.

    The sample exists to show integer tables behind DequantizeLinear. Should an
    ORT release stop quantizing Gather in QDQ mode, the fix is to rewrite the
    float export by hand (uint8 table + scalar scale/zero point + a
    DequantizeLinear before each use), not to ship a float model.
    """
    inits = {t.name: t for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    for node in model.graph.node:
        if node.op_type != "Gather":
            continue
        data = node.input[0]
        if data in inits:
            raise AssertionError(f"Gather {node.name} reads {data} unquantized")
        dq = producers.get(data)
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue  # a Gather on a shape, not on a table
        if inits[dq.input[0]].data_type not in (onnx.TensorProto.UINT8, onnx.TensorProto.INT8):
            raise AssertionError(f"{dq.input[0]} is not an 8-bit table")
        if any(inits[name].dims for name in dq.input[1:]):
            raise AssertionError(f"{dq.name}: scale/zero point are not per-tensor scalars")


def load_dequantized_tables(model: nn.Module, quantized: onnx.ModelProto) -> None:
    """Copy the values the QDQ graph really stores, (q - zp) * scale, into torch."""
    inits = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    params = dict(model.named_parameters())
    for node in quantized.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        q, scale, zero_point = (inits[name] for name in node.input[:3])
        # quantize_static names the integer copy "<initializer>_quantized";
        # a KeyError here means the naming changed and the mapping needs a look.
        param = params[node.input[0].removesuffix("_quantized")]
        table = (q.astype(np.float32) - zero_point.astype(np.float32)) * scale
        with torch.no_grad():
            param.copy_(torch.from_numpy(table))


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
    # Brings the torch model in line with values the export changed on purpose
    # (the quantized tables), so the comparison checks the graph itself.
    match_graph: Callable[[nn.Module, onnx.ModelProto], None] | None = None


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
        Sample("roberta_tiny_legacy_op14.onnx", lambda: build_roberta(torch_layer_norm),
               roberta_inputs, "last_hidden_state", export_legacy, 14),
        Sample("roberta_tiny_dynamo_op18.onnx", lambda: build_roberta(HandLayerNorm),
               roberta_inputs, "last_hidden_state", export_dynamo, 18),
        Sample("gpt2_tiny_legacy_op14.onnx", build_gpt2,
               llama_inputs, "last_hidden_state", export_legacy, 14),
        Sample("bert_embeddings_qdq_op14.onnx", build_bert_embeddings,
               embedding_inputs, "embeddings", export_legacy_qdq, 14,
               match_graph=load_dequantized_tables),
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
    if sample.match_graph is not None:
        before = torch_reference(model, check_inputs)
        sample.match_graph(model, proto)
        shift = float(np.abs(torch_reference(model, check_inputs) - before).max())
        print(f"  note: the graph's stored values move torch's output by up to {shift:.2e}")
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
        "DQ": count_ops(model, "DequantizeLinear"),
        "max_err": max_err,
        "kB": path.stat().st_size / 1024,
    }


def print_table(rows: list[dict[str, object]]) -> None:
    header = f"{'file':34} {'opset':>5} {'ir':>3} {'nodes':>5} {'funcs':>5} " \
             f"{'ReduceMean':>10} {'LayerNorm':>9} {'DQ':>3} {'max|ort-torch|':>14} {'kB':>6}"  # fmt: skip
    print(header)
    for r in rows:
        print(
            f"{r['file']:34} {r['opset']:>5} {r['ir']:>3} {r['nodes']:>5} {r['functions']:>5} "
            f"{r['ReduceMean']:>10} {r['LayerNorm']:>9} {r['DQ']:>3} {r['max_err']:>14.2e} "
            f"{r['kB']:>6.1f}"
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
