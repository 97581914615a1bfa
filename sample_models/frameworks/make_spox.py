"""spox: norms written op by op as a spox user writes them (the framework *is* ONNX, so nothing is exported; the
graph spox builds is the data).

Venv and versions (spox 0.18.2, onnx 1.23.2, onnxruntime 1.32.0, numpy 2.4):
    python -m venv /work/venv-spox && /work/venv-spox/bin/pip install spox onnxscript onnxruntime
    /work/venv-spox/bin/python sample_models/frameworks/make_spox.py

The expected outputs come from a float64 numpy evaluation of the same formulas (spox has no evaluator of its own).
Opset 18: ReduceMean takes its axes as an input (a Constant node, as spox writes every constant).

Models (hidden 32, sequence 8, batch 2; every gamma/beta random, not 1/0):
    layernorm           Dense -> ReduceMean, Sub, Mul(d, d), ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta
    rmsnorm             Dense -> x / Sqrt(ReduceMean(x * x) + eps) * w
    residual_layernorm  Dense -> Add x (post-norm residual) -> the LayerNorm above
    embedding_layernorm Gather(word, ids) + Gather(position, arange(S)) -> the LayerNorm above
    channels_first      [B, C, L] LayerNorm over axis 1, gamma/beta as [C, 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save, write_versions  # noqa: E402

import spox  # noqa: E402
import spox.opset.ai.onnx.v18 as op  # noqa: E402
from spox import Tensor, argument, build  # noqa: E402

H, S, B, V, EPS = 32, 8, 2, 50, 1e-5


def c(value) -> spox.Var:
    return op.constant(value=np.asarray(value))


def layer_norm(x, gamma, beta, axis=-1):
    mean = op.reduce_mean(x, c(np.array([axis], np.int64)), keepdims=1)
    d = op.sub(x, mean)
    var = op.reduce_mean(op.mul(d, d), c(np.array([axis], np.int64)), keepdims=1)
    y = op.div(d, op.sqrt(op.add(var, c(np.float32(EPS)))))
    return op.add(op.mul(y, c(gamma)), c(beta))


def rms_norm(x, w):
    ms = op.reduce_mean(op.mul(x, x), c(np.array([-1], np.int64)), keepdims=1)
    return op.mul(op.div(x, op.sqrt(op.add(ms, c(np.float32(EPS))))), c(w))


def ref_ln(x, g, b, axis=-1):
    x = x.astype(np.float64)
    m = x.mean(axis, keepdims=True)
    v = ((x - m) ** 2).mean(axis, keepdims=True)
    return ((x - m) / np.sqrt(v + EPS) * g + b).astype(np.float32)


def ref_rms(x, w):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w).astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(SEED)
    gamma, beta, w = perturbed(rng, H, 1.0), perturbed(rng, H, 0.0), perturbed(rng, H, 1.0)
    kernel = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
    bias = perturbed(rng, H, 0.0)
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    dense_ref = xs @ kernel + bias

    def dense(v):
        return op.add(op.matmul(v, c(kernel)), c(bias))

    x = argument(Tensor(np.float32, ("batch", S, H)))
    save("spox", "layernorm", build({"x": x}, {"y": layer_norm(dense(x), gamma, beta)}), [xs],
         ref_ln(dense_ref, gamma, beta))
    x = argument(Tensor(np.float32, ("batch", S, H)))
    save("spox", "rmsnorm", build({"x": x}, {"y": rms_norm(dense(x), w)}), [xs], ref_rms(dense_ref, w))
    x = argument(Tensor(np.float32, ("batch", S, H)))
    save("spox", "residual_layernorm", build({"x": x}, {"y": layer_norm(op.add(dense(x), x), gamma, beta)}),
         [xs], ref_ln(dense_ref + xs, gamma, beta))

    word = rng.standard_normal((V, H)).astype(np.float32)
    pos = rng.standard_normal((S, H)).astype(np.float32)
    ids = argument(Tensor(np.int64, ("batch", S)))
    emb = op.add(op.gather(c(word), ids), op.gather(c(pos), c(np.arange(S, dtype=np.int64))))
    ids_v = rng.integers(0, V, (B, S)).astype(np.int64)
    save("spox", "embedding_layernorm", build({"input_ids": ids}, {"y": layer_norm(emb, gamma, beta)}), [ids_v],
         ref_ln(word[ids_v] + pos[np.arange(S)], gamma, beta))

    x = argument(Tensor(np.float32, ("batch", H, S)))
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    save("spox", "channels_first",
         build({"x": x}, {"y": layer_norm(x, gamma[:, None], beta[:, None], axis=1)}), [xc],
         ref_ln(xc, gamma[:, None], beta[:, None], axis=1))
    write_versions("spox", {"spox": spox.__version__ if hasattr(spox, "__version__") else _dist("spox")})


def _dist(name: str) -> str:
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()
