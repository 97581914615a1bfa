"""MindSpore's own ONNX export (``mindspore.export(..., file_format="ONNX")``): the norms as MindSpore users write
them.

Venv and versions (mindspore 2.10.0 CPU, onnx 1.23.2, onnxruntime 1.32.0, numpy 1.26.4):
    python -m venv /work/venv-mindspore && /work/venv-mindspore/bin/pip install mindspore onnx onnxruntime \
        && /work/venv-mindspore/bin/pip install "numpy<2"
    /work/venv-mindspore/bin/python sample_models/frameworks/make_mindspore.py

MindSpore exports static shapes (batch 2 as exported). Hidden 32, sequence 8; every gamma/beta random.
    layernorm           nn.Dense -> nn.LayerNorm((32,), begin_norm_axis=-1, begin_params_axis=-1)
    rmsnorm             nn.Dense -> x / ops.sqrt(ops.mean(ops.square(x), -1, True) + eps) * w
    residual_layernorm  nn.Dense -> + x -> nn.LayerNorm (post-norm)
    embedding_layernorm nn.Embedding word(ids) + position(arange(S)) -> nn.LayerNorm
    channels_first      [B, C, L], normalized over axis 1 by hand ((x - mean) / sqrt(mean((x - mean)²) + eps)),
                        gamma/beta [C, 1]
The RMS norm as MindFormers writes it (``x * ops.rsqrt(...)``) cannot be exported: "Can not find key Rsqrt in
convert map. Exporting Rsqrt operator is not yet supported." Hence ``/ ops.sqrt``.
MindSpore 2.10 is built against numpy 1.x: after installing, ``pip install "numpy<2"`` (pip then warns that
ml-dtypes wants numpy 2; the export works), or every op fails with "A module that was compiled using NumPy 1.x".
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save_or_record, write_versions  # noqa: E402

import mindspore as ms  # noqa: E402
import onnx  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

H, S, B, V = 32, 8, 2, 50
rng = np.random.default_rng(SEED + 7)


def param(shape, centre, name):
    return Parameter(Tensor(perturbed(rng, shape, centre)), name=name)


def layer_norm(eps=1e-5):
    norm = nn.LayerNorm((H,), begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)
    norm.gamma.set_data(Tensor(perturbed(rng, H, 1.0)))
    norm.beta.set_data(Tensor(perturbed(rng, H, 0.0)))
    return norm


class DenseLN(nn.Cell):
    def __init__(self, residual=False):
        super().__init__()
        self.dense = nn.Dense(H, H)
        self.norm = layer_norm(1e-12 if residual else 1e-5)
        self.residual = residual

    def construct(self, x):
        h = self.dense(x)
        return self.norm(h + x if self.residual else h)


class RMSNorm(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = param((H,), 1.0, "weight")
        self.eps = 1e-6

    def construct(self, x):
        return x / ops.sqrt(ops.mean(ops.square(x), -1, True) + self.eps) * self.weight


class DenseRMS(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(H, H)
        self.norm = RMSNorm()

    def construct(self, x):
        return self.norm(self.dense(x))


class Embeddings(nn.Cell):
    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(V, H)
        self.position = nn.Embedding(S, H)
        self.norm = layer_norm(1e-12)
        self.position_ids = Tensor(np.arange(S, dtype=np.int32)[None])

    def construct(self, ids):
        return self.norm(self.word(ids) + self.position(self.position_ids))


class ChannelsFirst(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = param((H, 1), 1.0, "weight")
        self.bias = param((H, 1), 0.0, "bias")

    def construct(self, x):
        u = ops.mean(x, 1, True)
        s = ops.mean(ops.square(x - u), 1, True)
        return (x - u) / ops.sqrt(s + 1e-6) * self.weight + self.bias


def export(net, data) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        ms.export(net, Tensor(data), file_name=path, file_format="ONNX")
        return onnx.load(path + ".onnx")


def main() -> None:
    ms.set_seed(SEED)
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    ids = rng.integers(0, V, (B, S)).astype(np.int32)
    cases = {
        "layernorm": (DenseLN(), xs),
        "rmsnorm": (DenseRMS(), xs),
        "residual_layernorm": (DenseLN(residual=True), xs),
        "embedding_layernorm": (Embeddings(), ids),
        "channels_first": (ChannelsFirst(), xc),
    }
    failed: dict[str, str] = {}
    for name, (net, data) in cases.items():
        net.set_train(False)
        expected = net(Tensor(data)).asnumpy()
        try:
            proto = export(net, data)
        except Exception as exc:
            failed[name] = f"export fails: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"mindspore/{name}: NOT KEPT: {failed[name]}", flush=True)
            continue
        save_or_record(failed, "mindspore", name, proto, [data], expected)
    write_versions("mindspore", {"mindspore": ms.__version__}, failed)


if __name__ == "__main__":
    main()
