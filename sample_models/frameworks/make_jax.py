"""JAX through jax2onnx: Flax (nnx and linen) and Equinox models with their own norm layers.

Venv and versions (jax/jaxlib 0.10.2 as jax2onnx 0.17.1 resolves them, flax 0.12.8, equinox 0.13.8,
onnx 1.23.2, onnxruntime 1.32.0, numpy 2.4):
    python -m venv /work/venv-jax && /work/venv-jax/bin/pip install jax jaxlib flax equinox jax2onnx onnxruntime
    /work/venv-jax/bin/python sample_models/frameworks/make_jax.py

``jax2onnx.to_onnx`` at its defaults (opset 23, ``normalization_mode="auto"``), batch symbolic ("B").
Models (hidden 32, sequence 8, batch 2; every scale/bias random, not 1/0):
    flax_layernorm            nnx.Linear -> nnx.LayerNorm (Flax's one-pass variance, clamped by Max(var, 0))
    flax_rmsnorm              nnx.Linear -> nnx.RMSNorm
    flax_residual_layernorm   nnx.Linear -> + x -> nnx.LayerNorm (post-norm)
    flax_embedding_layernorm  nnx.Embed(word)(ids) + nnx.Embed(position)(arange(S)) -> nnx.LayerNorm
    flax_channels_first       nnx.LayerNorm(reduction_axes=1, feature_axes=1) on [B, C, L]
    linen_layernorm           flax.linen.LayerNorm applied with its params (the older Flax API)
    eqx_layernorm             eqx.nn.Linear -> eqx.nn.LayerNorm, vmapped over batch and sequence
    eqx_rmsnorm               eqx.nn.Linear -> eqx.nn.RMSNorm, vmapped
    eqx_residual_layernorm    eqx.nn.Linear -> + x -> eqx.nn.LayerNorm, vmapped
    eqx_embedding_layernorm   eqx.nn.Embedding word + position (vmapped lookups) -> eqx.nn.LayerNorm
    jnp_layernorm             hand-written: (x - x.mean(-1)) / jnp.sqrt(x.var(-1) + eps) * g + b (jnp.var)
    jnp_channels_first        hand-written over axis 1 of [B, C, L]: (x - m) * lax.rsqrt(((x - m) ** 2).mean(1) + eps)
Not kept: flax_channels_first (nnx.LayerNorm(reduction_axes=1, feature_axes=1)): jax2onnx 0.17.1 writes the scale
as [C] against the last axis, and ONNX Runtime refuses the model ("Incompatible dimensions" at the scale's Mul).
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save_or_record, write_versions  # noqa: E402

import equinox as eqx  # noqa: E402
import flax.linen as linen  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax2onnx import to_onnx  # noqa: E402

H, S, B, V = 32, 8, 2, 50
rng = np.random.default_rng(SEED + 4)


def set_norm(norm, with_bias: bool = True) -> None:
    norm.scale.set_value(jnp.asarray(perturbed(rng, norm.scale.get_value().shape, 1.0)))
    if with_bias:
        norm.bias.set_value(jnp.asarray(perturbed(rng, norm.bias.get_value().shape, 0.0)))


class FlaxLN(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(H, H, rngs=rngs)
        self.norm = nnx.LayerNorm(H, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


class FlaxRMS(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(H, H, rngs=rngs)
        self.norm = nnx.RMSNorm(H, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


class FlaxResidual(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(H, H, rngs=rngs)
        self.norm = nnx.LayerNorm(H, epsilon=1e-12, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x) + x)


class FlaxEmbeddings(nnx.Module):
    def __init__(self, rngs):
        self.word = nnx.Embed(V, H, rngs=rngs)
        self.position = nnx.Embed(S, H, rngs=rngs)
        self.norm = nnx.LayerNorm(H, epsilon=1e-12, rngs=rngs)

    def __call__(self, ids):
        return self.norm(self.word(ids) + self.position(jnp.arange(ids.shape[1])[None, :]))


class FlaxChannelsFirst(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(H, reduction_axes=1, feature_axes=1, rngs=rngs)

    def __call__(self, x):
        return self.norm(x)


class EqxLN(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.Module

    def __call__(self, x):  # x: [B, S, H]
        return jax.vmap(jax.vmap(lambda v: self.norm(self.dense(v))))(x)


class EqxResidual(EqxLN):
    def __call__(self, x):
        return jax.vmap(jax.vmap(lambda v: self.norm(self.dense(v) + v)))(x)


class EqxEmbeddings(eqx.Module):
    word: eqx.nn.Embedding
    position: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm

    def __call__(self, ids):  # ids: [B, S]
        def one(row):
            e = jax.vmap(self.word)(row) + jax.vmap(self.position)(jnp.arange(row.shape[0]))
            return jax.vmap(self.norm)(e)
        return jax.vmap(one)(ids)


def eqx_norm(norm):
    """The same layer with a random weight (and bias)."""
    norm = eqx.tree_at(lambda n: n.weight, norm, jnp.asarray(perturbed(rng, norm.weight.shape, 1.0)))
    if getattr(norm, "bias", None) is not None:
        norm = eqx.tree_at(lambda n: n.bias, norm, jnp.asarray(perturbed(rng, norm.bias.shape, 0.0)))
    return norm


def jnp_layernorm_factory():
    g, b = jnp.asarray(perturbed(rng, H, 1.0)), jnp.asarray(perturbed(rng, H, 0.0))

    def f(x):
        mean = x.mean(-1, keepdims=True)
        var = x.var(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * g + b
    return f


def jnp_channels_first_factory():
    g, b = jnp.asarray(perturbed(rng, (H, 1), 1.0)), jnp.asarray(perturbed(rng, (H, 1), 0.0))

    def f(x):  # [B, C, L], normalized over C as ConvNeXt's channels_first LayerNorm
        mean = x.mean(1, keepdims=True)
        var = ((x - mean) ** 2).mean(1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * g + b
    return f


def main() -> None:
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    ids = rng.integers(0, V, (B, S)).astype(np.int32)
    f32 = [("B", S, H)]
    ids_spec = [jax.ShapeDtypeStruct(jax.export.symbolic_shape(f"B, {S}"), jnp.int32)]
    keys = jax.random.split(jax.random.PRNGKey(SEED), 8)

    models = {}
    m = FlaxLN(nnx.Rngs(0)); set_norm(m.norm); models["flax_layernorm"] = (m, f32, xs)
    m = FlaxRMS(nnx.Rngs(1)); set_norm(m.norm, with_bias=False); models["flax_rmsnorm"] = (m, f32, xs)
    m = FlaxResidual(nnx.Rngs(2)); set_norm(m.norm); models["flax_residual_layernorm"] = (m, f32, xs)
    m = FlaxEmbeddings(nnx.Rngs(3)); set_norm(m.norm); models["flax_embedding_layernorm"] = (m, ids_spec, ids)
    m = FlaxChannelsFirst(nnx.Rngs(4)); set_norm(m.norm); models["flax_channels_first"] = (m, [("B", H, S)], xc)

    ln = linen.LayerNorm()
    assert set(ln.init(keys[0], jnp.ones((1, S, H)))["params"]) == {"scale", "bias"}
    params = {"params": {"scale": jnp.asarray(perturbed(rng, H, 1.0)), "bias": jnp.asarray(perturbed(rng, H, 0.0))}}
    models["linen_layernorm"] = (lambda x: ln.apply(params, x), f32, xs)

    models["eqx_layernorm"] = (EqxLN(eqx.nn.Linear(H, H, key=keys[1]), eqx_norm(eqx.nn.LayerNorm(H))), f32, xs)
    models["eqx_rmsnorm"] = (EqxLN(eqx.nn.Linear(H, H, key=keys[2]), eqx_norm(eqx.nn.RMSNorm(H))), f32, xs)
    models["eqx_residual_layernorm"] = (EqxResidual(eqx.nn.Linear(H, H, key=keys[3]),
                                                    eqx_norm(eqx.nn.LayerNorm(H, eps=1e-12))), f32, xs)
    models["eqx_embedding_layernorm"] = (EqxEmbeddings(eqx.nn.Embedding(V, H, key=keys[4]),
                                                       eqx.nn.Embedding(S, H, key=keys[5]),
                                                       eqx_norm(eqx.nn.LayerNorm(H, eps=1e-12))), ids_spec, ids)
    models["jnp_layernorm"] = (jnp_layernorm_factory(), f32, xs)
    models["jnp_channels_first"] = (jnp_channels_first_factory(), [("B", H, S)], xc)

    failed = {}
    for name, (fn, spec, data) in models.items():
        expected = np.asarray(fn(jnp.asarray(data)))
        proto = to_onnx(fn, spec, model_name=name)
        save_or_record(failed, "jax2onnx", name, proto, [data], expected)
    write_versions("jax2onnx", {k: version(k) for k in ("jax", "jaxlib", "flax", "equinox", "jax2onnx")}, failed)


if __name__ == "__main__":
    main()
