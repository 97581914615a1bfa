"""onnxscript: norms written as ``@script`` functions, as an onnxscript user writes them (the framework *is* ONNX).

Venv and versions (onnxscript 0.7.2, onnx 1.23.2, onnxruntime 1.32.0, numpy 2.4):
    python -m venv /work/venv-spox && /work/venv-spox/bin/pip install spox onnxscript onnxruntime
    /work/venv-spox/bin/python sample_models/frameworks/make_onnxscript.py

``to_model_proto()`` gives onnxscript's code form: every weight a ``Constant`` node followed by ``CastLike(w, x)``,
the epsilon a scalar ``Constant`` + ``CastLike``, the axes a ``Constant`` input (opset 18). The ``*_optimized``
models are the same functions after ``onnxscript.optimizer.optimize`` (CastLike folded, constants as initializers),
which is what most users ship. The expected outputs come from a float64 numpy evaluation of the same formulas.

Models (hidden 32, sequence 8, batch 2; every gamma/beta random, not 1/0):
    layernorm, layernorm_optimized      Dense -> ReduceMean, Sub, Mul(d, d), ReduceMean, Add eps, Sqrt, Div, *g, +b
    rmsnorm, rmsnorm_optimized          Dense -> x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) * w
    residual_layernorm                  Dense -> Add x -> LayerNorm
    embedding_layernorm                 Gather(word, ids) + Gather(position, arange(S)) -> LayerNorm
    channels_first                      [B, C, L] LayerNorm over axis 1, gamma/beta as [C, 1]
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save, write_versions  # noqa: E402

import onnxscript  # noqa: E402
from onnxscript import FLOAT, INT64, script  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

H, S, B, V = 32, 8, 2, 50
EPS = 1e-5
_rng = np.random.default_rng(SEED + 1)
GAMMA, BETA, W_RMS = perturbed(_rng, H, 1.0), perturbed(_rng, H, 0.0), perturbed(_rng, H, 1.0)
KERNEL = (_rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
BIAS = perturbed(_rng, H, 0.0)
WORD = _rng.standard_normal((V, H)).astype(np.float32)
POS = _rng.standard_normal((S, H)).astype(np.float32)
POS_IDS = np.arange(S, dtype=np.int64)
GAMMA_C, BETA_C = GAMMA[:, None].copy(), BETA[:, None].copy()


@script(default_opset=op)
def layernorm(x: FLOAT["batch", 8, 32]) -> FLOAT["batch", 8, 32]:
    h = op.MatMul(x, KERNEL) + BIAS
    mean = op.ReduceMean(h, [-1])
    d = h - mean
    var = op.ReduceMean(d * d, [-1])
    y = d / op.Sqrt(var + 1e-5) * GAMMA + BETA
    return y


@script(default_opset=op)
def rmsnorm(x: FLOAT["batch", 8, 32]) -> FLOAT["batch", 8, 32]:
    h = op.MatMul(x, KERNEL) + BIAS
    ms = op.ReduceMean(op.Pow(h, 2.0), [-1])
    y = h * op.Reciprocal(op.Sqrt(ms + 1e-5)) * W_RMS
    return y


@script(default_opset=op)
def residual_layernorm(x: FLOAT["batch", 8, 32]) -> FLOAT["batch", 8, 32]:
    h = op.MatMul(x, KERNEL) + BIAS
    s = h + x
    mean = op.ReduceMean(s, [-1])
    d = s - mean
    var = op.ReduceMean(d * d, [-1])
    y = d / op.Sqrt(var + 1e-5) * GAMMA + BETA
    return y


@script(default_opset=op)
def embedding_layernorm(input_ids: INT64["batch", 8]) -> FLOAT["batch", 8, 32]:
    e = op.Gather(WORD, input_ids) + op.Gather(POS, POS_IDS)
    mean = op.ReduceMean(e, [-1])
    d = e - mean
    var = op.ReduceMean(d * d, [-1])
    y = d / op.Sqrt(var + 1e-5) * GAMMA + BETA
    return y


@script(default_opset=op)
def channels_first(x: FLOAT["batch", 32, 8]) -> FLOAT["batch", 32, 8]:
    mean = op.ReduceMean(x, [1])
    d = x - mean
    var = op.ReduceMean(d * d, [1])
    y = d / op.Sqrt(var + 1e-5) * GAMMA_C + BETA_C
    return y


def ref_ln(x, g, b, axis=-1):
    x = x.astype(np.float64)
    m = x.mean(axis, keepdims=True)
    v = ((x - m) ** 2).mean(axis, keepdims=True)
    return ((x - m) / np.sqrt(v + EPS) * g + b).astype(np.float32)


def ref_rms(x, w):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w).astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(SEED + 2)
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    h = xs @ KERNEL + BIAS
    ids = rng.integers(0, V, (B, S)).astype(np.int64)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    cases = {
        "layernorm": (layernorm, [xs], ref_ln(h, GAMMA, BETA)),
        "rmsnorm": (rmsnorm, [xs], ref_rms(h, W_RMS)),
        "residual_layernorm": (residual_layernorm, [xs], ref_ln(h + xs, GAMMA, BETA)),
        "embedding_layernorm": (embedding_layernorm, [ids], ref_ln(WORD[ids] + POS, GAMMA, BETA)),
        "channels_first": (channels_first, [xc], ref_ln(xc, GAMMA_C, BETA_C, axis=1)),
    }
    for name, (fn, inputs, expected) in cases.items():
        save("onnxscript", name, fn.to_model_proto(), inputs, expected)
    for name in ("layernorm", "rmsnorm"):
        fn, inputs, expected = cases[name]
        save("onnxscript", f"{name}_optimized", onnxscript.optimizer.optimize(fn.to_model_proto()), inputs,
             expected)
    write_versions("onnxscript", {"onnxscript": version("onnxscript")})


if __name__ == "__main__":
    main()
