"""Write the graphs other tools' own test suites fuse (sample_models/peer_cases/*.onnx).

Each function builds, from the facts of a peer's test (its op sequence, shapes, attributes and what the test
expects fused; README.md names the test), a small model of our own. Weights are random, never 1 or 0, so a fusion
that drops or swaps gamma and beta shows. Run from the repo root:

    python sample_models/peer_cases/make_peer_cases.py            # onnx 1.23, torch 2.13 for the torch cases
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
from onnx import TensorProto

HERE = Path(__file__).resolve().parent
F32, F16, F64, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT32
B, S, D = 2, 4, 8


class Graph:
    """A tiny graph builder: every op returns its output name; constants become initializers."""

    def __init__(self, seed: int = 0):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def _name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(oh.make_tensor_value_info(name, elem, shape))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", outputs: int = 1, **attrs):
        outs = [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(oh.make_node(op_type, list(inputs), outs, name=self._name(op_type), domain=domain,
                                       **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype=np.float32, hint: str = "c") -> str:
        name = self._name(hint)
        self.inits.append(onh.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, shape: list[int], dtype=np.float32, hint: str = "w") -> str:
        """Random values away from 0 and 1 (a dropped or swapped gamma/beta changes the output)."""
        return self.const(self.rng.uniform(0.5, 1.5, size=shape) * self.rng.choice([-1, 1], size=shape), dtype,
                          hint)

    def model(self, outputs: list[tuple[str, int, list]], opset: int) -> onnx.ModelProto:
        """Outputs are declared with their type and shape, as the peers' tests declare them."""
        outs = [oh.make_tensor_value_info(name, elem, shape) for name, elem, shape in outputs]
        graph = oh.make_graph(self.nodes, "peer_case", self.inputs, outs, self.inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], producer_name="lnfuse peer_cases")
        model.ir_version = 10 if opset >= 23 else 8
        return model


def _reduce_mean(g: Graph, x: str, opset: int, axes=(-1,)) -> str:
    if opset >= 18:
        return g.op("ReduceMean", x, g.const(list(axes), np.int64, "axes"), keepdims=1)
    return g.op("ReduceMean", x, axes=list(axes), keepdims=1)


# ============================================================ onnxscript rules/fusion/_layer_norm*_test.py

def _onnxscript_ln(square: str, normalize: str, bias: bool, dtype=np.float32, elem=F32) -> onnx.ModelProto:
    """mean, d = x - mean, d*d or d**2 (the literal 2 an int64 exponent), var, sqrt(var + eps), then
    d * Reciprocal(std) or d / std, * scale (+ bias): [2, 4, 8] at opset 18, epsilon a Constant node of 1e-5; scale
    and bias are graph inputs."""
    g = Graph()
    x = g.input("x", elem, [2, 4, 8])
    mean = _reduce_mean(g, x, 18)
    d = g.op("Sub", x, mean)
    sq = g.op("Mul", d, d) if square == "mul" else g.op("Pow", d, g.const(2, np.int64, "two"))
    var = _reduce_mean(g, sq, 18)
    eps = g.op("Constant", value=onh.from_array(np.array(1e-5, dtype=dtype), "eps"))
    std = g.op("Sqrt", g.op("Add", var, eps))
    n = g.op("Mul", d, g.op("Reciprocal", std)) if normalize == "recip" else g.op("Div", d, std)
    y = g.op("Mul", n, g.input("scale", elem, [8]))
    if bias:
        y = g.op("Add", y, g.input("bias", elem, [8]))
    return g.model([(y, elem, [2, 4, 8])], 18)


# ============================================ onnxscript ort_fusions/rms_normalization*_test.py, rules/fusion

def _onnxscript_rms(scale_first: bool, dtype=np.float32, elem=F32, cast_io: bool = False, int_input: bool = False,
                    opset: int = 18, shape=("B", "S", 16)) -> onnx.ModelProto:
    """x**2.0, ReduceMean(axes [-1]), + eps (1e-6 constant [1]), Sqrt, Reciprocal, x * inv, * scale (either
    order; scale a graph input); the mixed-precision form casts fp16 x to fp32 first and the normalized value back
    before the fp16 scale."""
    g = Graph(1)
    x = g.input("x", I32 if int_input else (F16 if cast_io else elem), list(shape))
    xf = g.op("Cast", x, to=F32) if (cast_io or int_input) else x
    sq = g.op("Pow", xf, g.const(2.0, dtype, "two"))
    ms = _reduce_mean(g, sq, opset)
    eps = g.op("Constant", value=onh.from_array(np.array([1e-6 if opset < 23 else 1e-5], dtype=dtype), "eps"))
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, eps)))
    n = g.op("Mul", xf, inv)
    if cast_io:
        n = g.op("Cast", n, to=F16)
    scale = g.input("scale", F16 if cast_io else elem, [shape[-1]])
    y = g.op("Mul", scale, n) if scale_first else g.op("Mul", n, scale)
    return g.model([(y, F16 if cast_io else elem, list(shape))], opset)


# =================================================== onnxscript ort_fusions/skip_normalization_unit_test.py

def _onnxscript_skip(norm: str, order: str, rank: int = 3) -> onnx.ModelProto:
    """Add(input, skip) (or skip + input; or with a bias added after the sum, or to input before it), then an
    existing SimplifiedLayerNormalization / LayerNormalization (axis -1, epsilon 1e-6, stash_type 1); gamma, beta
    and bias are graph inputs."""
    g = Graph(2)
    shape = [B, 8, 16] if rank == 3 else [8, 16]
    x = g.input("input", F32, shape)
    skip = g.input("skip", F32, shape)
    if order == "no_add":
        total = x
    elif order == "skip_input":
        total = g.op("Add", skip, x)
    elif order == "pre_bias":
        total = g.op("Add", g.op("Add", x, g.input("bias", F32, [16])), skip)
    else:
        total = g.op("Add", x, skip)
        if order == "post_bias":
            total = g.op("Add", total, g.input("bias", F32, [16]))
    gamma = g.input("gamma", F32, [16])
    if norm == "rms":
        y = g.op("SimplifiedLayerNormalization", total, gamma, axis=-1, epsilon=1e-6, stash_type=1)
    else:
        y = g.op("LayerNormalization", total, gamma, g.input("beta", F32, [16]), axis=-1, epsilon=1e-6,
                 stash_type=1)
    return g.model([(y, F32, shape)], 18)


# ======================================================= ORT python optimizer: bert/gpt2 attention generators

def _ort_attention_block(gpt2: bool, switch: bool) -> onnx.ModelProto:
    """bert_model_generator.create_bert_attention / gpt2_model_generator.create_gpt2_attention, the norm facts:
    Add(input_1, input_2) -> LayerNormalization; the attention output (here its last projection, MatMul + bias
    Add, with `switch_add_inputs` swapping the Add operands) is added to the residual -- the first norm's output
    (BERT, post-norm) or the first sum (GPT-2, pre-norm) -- then the same LayerNormalization again. ORT's
    attention tests expect both Add + LayerNormalization pairs as SkipLayerNormalization."""
    g = Graph(3)
    a = g.input("input_1", F32, [1, 3, 16])
    b = g.input("input_2", F32, [1, 3, 16])
    gamma, beta = g.weight([16], hint="layer_norm_weight"), g.weight([16], hint="layer_norm_bias")
    total = g.op("Add", a, b)
    ln = g.op("LayerNormalization", total, gamma, beta, axis=-1, epsilon=9.999999747378752e-06)
    proj = g.op("MatMul", ln, g.weight([16, 16], hint="matmul_qkv_weight"))
    bias = g.weight([16], hint="add_qkv_weight")
    out = g.op("Add", *([bias, proj] if switch else [proj, bias]))
    residual = total if gpt2 else ln
    skip = g.op("Add", *([residual, out] if switch else [out, residual]))
    y = g.op("LayerNormalization", skip, gamma, beta, axis=-1, epsilon=9.999999747378752e-06)
    return g.model([(y, F32, [1, 3, 16])], 17)


def _decomposed_ln(g: Graph, x: str, opset: int, dup_sub: bool, hidden: int, eps: float = 1e-5) -> str:
    """PyTorch 1.x's LayerNorm export: ReduceMean(axes=[-1]) Sub Pow(2) ReduceMean Add(eps) Sqrt Div Mul Add; old
    exports write the Sub twice (one for Pow, one for Div)."""
    mean = _reduce_mean(g, x, opset)
    d = g.op("Sub", x, mean)
    var = _reduce_mean(g, g.op("Pow", d, g.const(2.0, hint="two")), opset)
    std = g.op("Sqrt", g.op("Add", var, g.const(eps, hint="eps")))
    n = g.op("Div", g.op("Sub", x, mean) if dup_sub else d, std)
    return g.op("Add", g.op("Mul", n, g.weight([hidden], hint="ln_weight")), g.weight([hidden], hint="ln_bias"))


def _ort_gpt2_past(layers: int = 2, hidden: int = 4) -> onnx.ModelProto:
    """test_optimizer.test_gpt2_past's model (gpt2_pytorch1.5_opset11, hidden 4): pre-norm GPT-2 blocks,
    h += attn(ln_1(h)); h += mlp(ln_2(h)); ln_f(h), each norm PyTorch 1.5's decomposition at opset 11 with the
    duplicated Sub. ORT expects 2 * layers + 1 LayerNormalization (12 layers: 25). The attention and MLP are
    stood in for by Gemm-like MatMul + bias projections."""
    g = Graph(4)
    h = g.input("hidden_states", F32, ["batch", "seq", hidden])
    for layer in range(layers):
        for _part in ("attn", "mlp"):
            n = _decomposed_ln(g, h, 11, dup_sub=layer % 2 == 0, hidden=hidden)
            proj = g.op("Add", g.op("MatMul", n, g.weight([hidden, hidden])), g.weight([hidden], hint="b"))
            h = g.op("Add", h, proj)
    y = _decomposed_ln(g, h, 11, dup_sub=True, hidden=hidden)
    return g.model([(y, F32, ["batch", "seq", hidden])], 11)


def _keras2onnx_ln(g: Graph, x: str, hidden: int, eps: float = 1e-12) -> str:
    """keras2onnx's LayerNormalization (ORT's FusionLayerNormalizationTF): mean, d = x - mean, d*d, var,
    Sqrt(var + eps), Reciprocal, k = inv * gamma, then x*k + (beta - mean*k)."""
    mean = _reduce_mean(g, x, 11)
    d = g.op("Sub", x, mean)
    var = _reduce_mean(g, g.op("Mul", d, d), 11)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(eps, hint="eps"))))
    k = g.op("Mul", inv, g.weight([hidden], hint="gamma"))
    shift = g.op("Sub", g.weight([hidden], hint="beta"), g.op("Mul", mean, k))
    return g.op("Add", g.op("Mul", x, k), shift)


def _ort_keras_bert(layers: int = 2, hidden: int = 8) -> onnx.ModelProto:
    """test_optimizer's keras2onnx BERT (bert_keras_0 / bert_keras_squad, hidden 8): post-norm encoder layers,
    h = LN(h + attn(h)); h = LN(h + ffn(h)), the norms in keras2onnx's folded spelling. ORT expects every norm a
    SkipLayerNormalization (TFBertForSequenceClassification: 25 in 12 layers: the embedding sum's norm too)."""
    g = Graph(5)
    words = g.input("word_embeddings", F32, ["batch", 7, hidden])
    h = _keras2onnx_ln(g, g.op("Add", words, g.weight([7, hidden], hint="position_embeddings")), hidden)
    for _layer in range(layers):
        for _part in ("attn", "ffn"):
            proj = g.op("Add", g.op("MatMul", h, g.weight([hidden, hidden])), g.weight([hidden], hint="b"))
            h = _keras2onnx_ln(g, g.op("Add", proj, h), hidden)
    return g.model([(h, F32, ["batch", 7, hidden])], 11)


# ======================================================== ORT python optimizer: test_phi_vision.py (torch)

def _torch_export(module, args, names: list[str]) -> onnx.ModelProto:
    import torch

    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, args, buffer, opset_version=14, input_names=names, dynamo=False,
                          do_constant_folding=True)
    return onnx.load_from_string(buffer.getvalue())


def _phi_vision_models() -> dict[str, onnx.ModelProto]:
    """test_phi_vision: CLIP's LayerNorm written line by line in fp16 with the deviation cast to fp64 for the
    variance and the quotient cast back to fp16 before weight and bias (ORT expects one LayerNormalization), and
    x + x -> nn.LayerNorm -> attention -> residual + x -> the same nn.LayerNorm (ORT expects both as
    SkipLayerNormalization). Both exported by torch's TorchScript exporter at opset 14, as the test does."""
    import torch

    torch.manual_seed(0)

    class LineByLineLayerNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(20, dtype=torch.float16) + 0.5)
            self.bias = torch.nn.Parameter(torch.rand(20, dtype=torch.float16) - 0.5)

        def forward(self, x):
            mean = x.mean(-1, keepdim=True)
            diff = (x - mean).to(torch.float64)
            variance = diff.pow(2).mean(-1, keepdim=True)
            y = diff / torch.sqrt(variance + 1e-5)
            return y.to(torch.float16) * self.weight + self.bias

    class AttentionAndLayerNorm(torch.nn.Module):
        def __init__(self, dim: int = 20, heads: int = 2):
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))
            self.ln = torch.nn.LayerNorm(dim, eps=1e-5)
            with torch.no_grad():
                self.ln.weight.uniform_(0.5, 1.5)
                self.ln.bias.uniform_(-0.5, 0.5)

        def split(self, t, batch):
            return t.view(batch, -1, self.heads, self.head_dim).transpose(1, 2)

        def forward(self, x):
            x = self.ln(x + x)
            residual = x
            batch = x.shape[0]
            q = self.split(self.q(x) * self.head_dim ** -0.5, batch)
            k, v = self.split(self.k(x), batch), self.split(self.v(x), batch)
            attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            x = self.out(attn.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim))
            return self.ln(residual + x)

    return {
        "ort_phi_vision_layernorm_fp16": _torch_export(LineByLineLayerNorm().eval(),
                                                       (torch.randn(1, 2, 20).half(),), ["input"]),
        "ort_phi_vision_attention_layernorm": _torch_export(AttentionAndLayerNorm().eval(),
                                                            (torch.randn(1, 2, 20),), ["input"]),
    }


# =============================================== ORT python optimizer: test_skip_layer_norm_fusion.py

def _ort_skip_fusion(graph_output: bool, bias: int = 0, cast: bool = False) -> onnx.ModelProto:
    """Add(input_1, input_2) -> LayerNormalization (opset 16: ONNX Runtime's own LayerNormalization) on
    [1, 2, 3]; the sum also a graph output or not; one addend MatMul(input_0, W) + bias (`bias` 1 or 2 says which),
    with input_0 and W in float16 and a Cast to float before the bias Add when `cast`. ORT expects one
    SkipLayerNormalization and no Add (the bias becomes the Skip op's bias input; the Cast stays)."""
    g = Graph(6)
    shape = [1, 2, 3]
    addends = {1: "input_1", 2: "input_2"}
    for index, name in addends.items():
        if index != bias:
            g.input(name, F32, shape)
    if bias:
        x = g.input("input_0", F16 if cast else F32, shape)
        product = g.op("MatMul", x, g.weight([3, 3], np.float16 if cast else np.float32, "matmul_weight"))
        if cast:
            product = g.op("Cast", product, to=F32)
        addends[bias] = g.op("Add", product, g.weight([3], hint="bias"))
    total = g.op("Add", addends[1], addends[2])
    y = g.op("LayerNormalization", total, g.weight([3], hint="layer_norm_weight"),
             g.weight([3], hint="layer_norm_bias"), axis=-1, epsilon=9.999999747378752e-06)
    outputs = [(y, F32, shape)] + ([(total, F32, shape)] if graph_output else [])
    return g.model(outputs, 16)


# ========================================== ORT python optimizer: test_embedlayer_fusion.py (gpt2 generator)

def _ort_gpt2_embedlayer(skip_op: bool, output_sum: bool, hidden: int = 16) -> onnx.ModelProto:
    """gpt2_model_generator.create_gpt2_embedlayer: int32 `ids` [batch, seq] index the word (101 rows), position
    (100) and token-type (10) tables alike; word + position, then + token-type and the norm, written as ONNX
    Runtime's SkipLayerNormalization (no com.microsoft import, as the generator writes it) or as Add +
    LayerNormalization at opset 16, epsilon 0.1; the sum also a graph output or not. The norm feeds q/k/v MatMuls
    summed, then a SkipLayerNormalization with a bias. ORT expects EmbedLayerNormalization (ids as input, segment
    and position ids) and the attention's SkipLayerNormalization."""
    g = Graph(7)
    ids = g.input("ids", I32, ["batch_size", "sequence_length"])
    word, pos, token = (g.weight([rows, hidden], hint=name) for rows, name in
                        ((101, "word_embeddings_weight"), (100, "pos_embeddings_weight"),
                         (10, "token_embeddings_weight")))
    gamma, beta = g.weight([hidden], hint="layernorm_weight"), g.weight([hidden], hint="layernorm_bias")
    first = g.op("Add", g.op("Gather", word, ids), g.op("Gather", pos, ids))
    token_rows = g.op("Gather", token, ids)
    if skip_op:
        norm, _, _, total = g.op("SkipLayerNormalization", first, token_rows, gamma, beta, domain="com.microsoft",
                                 outputs=4, epsilon=0.1)
        if not output_sum:
            del g.nodes[-1].output[1:]  # the generator names the sum output only when it is a graph output
    else:
        total = g.op("Add", first, token_rows)
        norm = g.op("LayerNormalization", total, gamma, beta, epsilon=0.1)
    qkv = [g.op("MatMul", norm, g.weight([hidden, hidden], hint=f"{n}_weight")) for n in "qkv"]
    attention = g.op("Add", g.op("Add", qkv[0], qkv[1]), qkv[2])
    y = g.op("SkipLayerNormalization", norm, attention, gamma, beta, g.weight([hidden], hint="dense_bias"),
             domain="com.microsoft", epsilon=0.1)
    shape = ["batch_size", "sequence_length", hidden]
    return g.model([(y, F32, shape)] + ([(total, F32, shape)] if output_sum else []), 16)


# =========================== ORT C++ fusion test generators not in sample_models/ort_fusion (testdata/transform/fusion)

def _ort_ln_without_scale_bias() -> onnx.ModelProto:
    """layer_norm_without_scale_bias.py: opset 12, X [16, 32, 4], ReduceMean(axes=[-1]) Sub Pow(2) ReduceMean
    Add(0) Sqrt Div and nothing after: a LayerNorm with neither scale nor bias, epsilon 0 (LayerNormFusion writes
    one LayerNormalization with a scale of ones)."""
    g = Graph(8)
    x = g.input("X", F32, [16, 32, 4])
    mean = _reduce_mean(g, x, 12)
    d = g.op("Sub", x, mean)
    var = _reduce_mean(g, g.op("Pow", d, g.const(2.0, hint="pow_in_2")), 12)
    y = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(0.0, hint="const_0"))))
    return g.model([(y, F32, [16, 32, 4])], 12)


def _ort_ln_fp16_op10() -> onnx.ModelProto:
    """layer_norm_fp16.py: the decomposed LayerNorm in float16 at opset 10 on X [M, N], Scale and B graph inputs,
    Mul(Scale, quotient), Pow exponent and epsilon (1e-4) float16 initializers of shape [1]."""
    g = Graph(9)
    x = g.input("X", F16, ["M", "N"])
    mean = _reduce_mean(g, x, 10)
    d = g.op("Sub", x, mean)
    var = _reduce_mean(g, g.op("Pow", d, g.const([2], np.float16, "Pow_B")), 10)
    n = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const([1e-4], np.float16, "add_B"))))
    y = g.op("Add", g.op("Mul", g.input("Scale", F16, ["N"]), n), g.input("B", F16, ["N"]))
    return g.model([(y, F16, ["M", "N"])], 10)


def _ort_sln_fp16_pow_edge() -> onnx.ModelProto:
    """gen_simplified_layer_norm_fp16_pow_edge.py: opset 12, float16 x [1, 4, 8], x ** Cast(float 2.0 to fp16),
    ReduceMean, + `bias` and * `scale`, both graph inputs of shape [1, 4, 1]: the epsilon is a run-time value and
    the scale is one number per row, so this is no RMS norm any kernel computes (an edge case the fuser must
    survive)."""
    g = Graph(10)
    x = g.input("x", F16, [1, 4, 8])
    exponent = g.op("Cast", g.const([2.0], hint="exponent"), to=F16)
    ms = _reduce_mean(g, g.op("Pow", x, exponent), 12)
    n = g.op("Div", x, g.op("Sqrt", g.op("Add", ms, g.input("bias", F16, [1, 4, 1]))))
    y = g.op("Mul", n, g.input("scale", F16, [1, 4, 1]))
    return g.model([(y, F16, [1, 4, 8])], 12)


# ============================ ORT python optimizer: test_optimizer_huggingface_bert.py (transformers, torch)

def _hf_encoder_models() -> dict[str, onnx.ModelProto]:
    """test_optimizer_huggingface_bert: Hugging Face's tiny random BERT (5 layers, hidden 32, 4 heads,
    intermediate 37), DistilBERT and XLM-RoBERTa (2 layers) exported by torch's TorchScript exporter at opset 16
    with the first 1 or 2 of input_ids, attention_mask, token_type_ids. With transformers >= 5 ORT's test expects
    LayerNormalization 1 and SkipLayerNormalization 10 (XLM-R: 1 and 4). Built here from those config facts with
    random weights; vocabularies of 100 and 64 positions keep the files small (the graphs do not depend on it)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=100, max_position_embeddings=64)
    models = {
        "ort_hf_bert_1input_op16": (tf.BertModel(tf.BertConfig(
            hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=37, type_vocab_size=16,
            **common)), 1),
        "ort_hf_distilbert_2inputs_op16": (tf.DistilBertModel(tf.DistilBertConfig(
            dim=32, n_layers=5, n_heads=4, hidden_dim=37, **common)), 2),
        "ort_hf_xlm_roberta_1input_op16": (tf.XLMRobertaModel(tf.XLMRobertaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, **common)), 1),
    }

    class Outputs(torch.nn.Module):
        """The model called with its inputs by name, returning last_hidden_state."""

        def __init__(self, model, names):
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *inputs):
            return self.model(**dict(zip(self.names, inputs))).last_hidden_state

    made = {}
    for name, (model, count) in models.items():
        names = ["input_ids", "attention_mask", "token_type_ids"][:count]
        buffer = io.BytesIO()
        with torch.no_grad():
            torch.onnx.export(Outputs(model.eval(), names), tuple(torch.ones(1, 8, dtype=torch.long) for _ in names),
                              buffer, opset_version=16, input_names=names, output_names=["last_hidden_state"],
                              dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names}, dynamo=False)
        made[name] = onnx.load_from_string(buffer.getvalue())
    return made


# ================================================================================================ registry

CASES: dict[str, Callable[[], onnx.ModelProto]] = {
    "os_ln_recip": lambda: _onnxscript_ln("mul", "recip", bias=False),
    "os_ln_recip_bias": lambda: _onnxscript_ln("mul", "recip", bias=True),
    "os_ln_pow_recip": lambda: _onnxscript_ln("pow", "recip", bias=False),
    "os_ln_div": lambda: _onnxscript_ln("mul", "div", bias=False),
    "os_ln_pow_div": lambda: _onnxscript_ln("pow", "div", bias=False),
    "os_ln_div_bias": lambda: _onnxscript_ln("mul", "div", bias=True),
    "os_ln_double": lambda: _onnxscript_ln("mul", "recip", bias=False, dtype=np.float64, elem=F64),
    "os_ln_fp16": lambda: _onnxscript_ln("mul", "recip", bias=False, dtype=np.float16, elem=F16),
    "os_rms_scale_first": lambda: _onnxscript_rms(scale_first=True),
    "os_rms_norm_first": lambda: _onnxscript_rms(scale_first=False),
    "os_rms_cast_fp16": lambda: _onnxscript_rms(scale_first=False, cast_io=True),
    "os_rms_double": lambda: _onnxscript_rms(scale_first=False, dtype=np.float64, elem=F64),
    "os_rms_int_input": lambda: _onnxscript_rms(scale_first=False, int_input=True),
    "os_rms_rank1_op23": lambda: _onnxscript_rms(scale_first=True, opset=23, shape=(128,)),
    "os_skip_sln_input_skip": lambda: _onnxscript_skip("rms", "input_skip"),
    "os_skip_sln_skip_input": lambda: _onnxscript_skip("rms", "skip_input"),
    "os_skip_sln_post_bias": lambda: _onnxscript_skip("rms", "post_bias"),
    "os_skip_sln_pre_bias": lambda: _onnxscript_skip("rms", "pre_bias"),
    "os_skip_ln_input_skip": lambda: _onnxscript_skip("ln", "input_skip"),
    "os_skip_ln_post_bias": lambda: _onnxscript_skip("ln", "post_bias"),
    "os_skip_sln_rank2": lambda: _onnxscript_skip("rms", "input_skip", rank=2),
    "os_sln_no_add": lambda: _onnxscript_skip("rms", "no_add"),
    "ort_bert_attention_skip": lambda: _ort_attention_block(gpt2=False, switch=False),
    "ort_bert_attention_skip_switched": lambda: _ort_attention_block(gpt2=False, switch=True),
    "ort_gpt2_attention_skip": lambda: _ort_attention_block(gpt2=True, switch=False),
    "ort_gpt2_attention_skip_switched": lambda: _ort_attention_block(gpt2=True, switch=True),
    "ort_gpt2_past_pt15_op11": _ort_gpt2_past,
    "ort_keras2onnx_bert_op11": _ort_keras_bert,
    "ort_gpt2_embedlayer": lambda: _ort_gpt2_embedlayer(skip_op=True, output_sum=False),
    "ort_gpt2_embedlayer_output_sum": lambda: _ort_gpt2_embedlayer(skip_op=True, output_sum=True),
    "ort_gpt2_embedlayer_add_layernorm": lambda: _ort_gpt2_embedlayer(skip_op=False, output_sum=False),
    "ort_ln_without_scale_bias_op12": _ort_ln_without_scale_bias,
    "ort_ln_fp16_op10": _ort_ln_fp16_op10,
    "ort_sln_fp16_pow_edge_op12": _ort_sln_fp16_pow_edge,
    "ort_skip_fusion_no_graph_output": lambda: _ort_skip_fusion(graph_output=False),
    "ort_skip_fusion_graph_output": lambda: _ort_skip_fusion(graph_output=True),
    "ort_skip_fusion_graph_output_bias1": lambda: _ort_skip_fusion(graph_output=True, bias=1),
    "ort_skip_fusion_graph_output_bias2": lambda: _ort_skip_fusion(graph_output=True, bias=2),
    "ort_skip_fusion_graph_output_cast_bias1": lambda: _ort_skip_fusion(graph_output=True, bias=1, cast=True),
    "ort_skip_fusion_graph_output_cast_bias2": lambda: _ort_skip_fusion(graph_output=True, bias=2, cast=True),
}


def main(argv: list[str]) -> None:
    made = {name: make() for name, make in CASES.items()}
    if "--no-torch" not in argv:
        made.update(_phi_vision_models())
        made.update(_hf_encoder_models())
    for name, model in made.items():
        onnx.save_model(model, str(HERE / f"{name}.onnx"))
        print(f"{name}.onnx: {len(model.graph.node)} nodes")


if __name__ == "__main__":
    main(sys.argv[1:])
