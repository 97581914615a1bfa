"""PaddlePaddle through paddle2onnx (``paddle.onnx.export``): tiny models with the norms as Paddle users write them.

Venv and versions (paddlepaddle 3.3.1 CPU, paddle2onnx 2.1.0, onnxruntime 1.32.0, numpy 2.4, onnx 1.17 as
paddle2onnx pins it):
    python -m venv /work/venv-paddle && /work/venv-paddle/bin/pip install paddlepaddle paddle2onnx onnxruntime
    /work/venv-paddle/bin/python sample_models/frameworks/make_paddle.py

Each model is exported at opset 11 (below LayerNormalization: paddle2onnx decomposes ``layer_norm``) and at
opset 17 (``layer_norm`` as ONNX LayerNormalization). Models (hidden 32, sequence 8, batch 2; gamma/beta random):
    layernorm           nn.Linear -> nn.LayerNorm(32)
    rmsnorm             nn.Linear -> PaddleNLP's LlamaRMSNorm: rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * x * w
    residual_layernorm  BERT's post-norm output block: LayerNorm(Dropout(Linear(x)) + x), eval mode
    embedding_layernorm BERT embeddings: word + position (arange) lookups, LayerNorm, Dropout (eval)
    channels_first      PaddleClas ConvNeXt's channels_first LayerNorm on [B, C, L] (mean over axis 1 by hand)
"""

from __future__ import annotations

import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save, write_versions  # noqa: E402

import onnx  # noqa: E402
import paddle  # noqa: E402
from paddle import nn  # noqa: E402

H, S, B, V, EPS = 32, 8, 2, 50, 1e-5
OPSETS = (11, 17)


class LayerNormModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H, epsilon=EPS)

    def forward(self, x):
        return self.norm(self.dense(x))


class RMSNorm(nn.Layer):
    """PaddleNLP's LlamaRMSNorm."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([H], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = paddle.rsqrt(variance + self.variance_epsilon) * hidden_states
        return hidden_states * self.weight


class RMSNormModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(H, H)
        self.norm = RMSNorm()

    def forward(self, x):
        return self.norm(self.dense(x))


class ResidualLayerNorm(nn.Layer):
    """BERT's output block (post-norm): LayerNorm(dropout(dense(h)) + input)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(H, H)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(H, epsilon=1e-12)

    def forward(self, x):
        return self.norm(self.dropout(self.dense(x)) + x)


class Embeddings(nn.Layer):
    """BERT embeddings without token types: word + position lookups, LayerNorm, dropout."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(V, H)
        self.position_embeddings = nn.Embedding(S, H)
        self.layer_norm = nn.LayerNorm(H, epsilon=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids):
        position_ids = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        e = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.layer_norm(e))


class ChannelsFirst(nn.Layer):
    """PaddleClas ConvNeXt's LayerNorm with data_format="channels_first", on [B, C, L]."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([H], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([H], default_initializer=nn.initializer.Constant(0.0))
        self.eps = 1e-6

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / paddle.sqrt(s + self.eps)
        return self.weight[:, None] * x + self.bias[:, None]


def randomize(model: nn.Layer, rng: np.random.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("weight") and ("norm" in name or p.shape == [H] and "dense" not in name):
            p.set_value(perturbed(rng, p.shape, 1.0))
        elif name.endswith("bias"):
            p.set_value(perturbed(rng, p.shape, 0.0))


def export(model: nn.Layer, spec, opset: int) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "model")
        paddle.onnx.export(model, prefix, input_spec=spec, opset_version=opset)
        return onnx.load(prefix + ".onnx")


def main() -> None:
    paddle.seed(SEED)
    rng = np.random.default_rng(SEED + 3)
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    ids = rng.integers(0, V, (B, S)).astype(np.int64)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    f32 = paddle.static.InputSpec([None, S, H], "float32", "x")
    cases = {
        "layernorm": (LayerNormModel, f32, xs),
        "rmsnorm": (RMSNormModel, f32, xs),
        "residual_layernorm": (ResidualLayerNorm, f32, xs),
        "embedding_layernorm": (Embeddings, paddle.static.InputSpec([None, S], "int64", "input_ids"), ids),
        "channels_first": (ChannelsFirst, paddle.static.InputSpec([None, H, S], "float32", "x"), xc),
    }
    for name, (cls, spec, data) in cases.items():
        model = cls()
        randomize(model, rng)
        model.eval()
        expected = model(paddle.to_tensor(data)).numpy()
        for opset in OPSETS:
            save("paddle", f"{name}_op{opset}", export(model, [spec], opset), [data], expected)
    write_versions("paddle", {"paddlepaddle": paddle.__version__, "paddle2onnx": version("paddle2onnx")})


if __name__ == "__main__":
    main()
