"""JAX through jax2tf + tf2onnx: Flax linen and Equinox models converted to a TF graph, then to ONNX.

jax2tf's non-native path (``native_serialization=False``, ``enable_xla=False``: plain TF ops, which tf2onnx can
read) is gone from current JAX (0.10 only writes XlaCallModule, which tf2onnx cannot convert), so this venv pins
the last JAX that has it, with the Flax and Equinox of that time. Venv and versions (jax/jaxlib 0.4.30,
flax 0.8.5, equinox 0.11.4, tensorflow-cpu 2.21.0, tf2onnx 1.17.0, onnx 1.23.2, onnxruntime 1.32.0, numpy 2.4):
    python -m venv /work/venv-jax2tf && /work/venv-jax2tf/bin/pip install jax==0.4.30 jaxlib==0.4.30 \\
        flax==0.8.5 equinox==0.11.4 tensorflow-cpu==2.21.0 tf2onnx==1.17.0 onnxruntime
    /work/venv-jax2tf/bin/python sample_models/frameworks/make_jax2tf.py

``jax2tf.convert(f, native_serialization=False, enable_xla=False, polymorphic_shapes=["(b, ...)"])`` in a
``tf.function``, then ``tf2onnx.convert.from_function(opset=17)``. Hidden 32, sequence 8, batch 2; scale/bias random.
    flax_layernorm            linen.Dense -> linen.LayerNorm (one-pass variance clamped at 0)
    flax_rmsnorm              linen.Dense -> linen.RMSNorm
    flax_residual_layernorm   linen.Dense -> + x -> linen.LayerNorm
    flax_embedding_layernorm  linen.Embed(word)(ids) + linen.Embed(position)(arange(S)) -> linen.LayerNorm
    flax_indexed_embedding_layernorm  the same with jnp.take(table, ids, axis=0, mode="clip"), batch static (2)
    flax_channels_first       linen.LayerNorm(reduction_axes=1, feature_axes=1) on [B, C, L]
    eqx_layernorm             eqx.nn.Linear -> eqx.nn.LayerNorm (jnp.var), vmapped over batch and sequence
    eqx_rmsnorm               eqx.nn.Linear -> eqx.nn.RMSNorm, vmapped
    eqx_residual_layernorm    eqx.nn.Linear -> + x -> eqx.nn.LayerNorm, vmapped
    eqx_embedding_layernorm   eqx.nn.Embedding word + position -> eqx.nn.LayerNorm, vmapped
Not kept (recorded in jax2tf/versions.json):
    flax_embedding_layernorm   nn.Embed looks up with ``jnp.take`` (mode "fill": out-of-range rows are NaN);
                               jax2tf writes SelectV2(in_range, gathered, NaN) and tf2onnx lowers a float SelectV2
                               to ``Cast(c) * a + Cast(!c) * b``, where 0 * NaN is NaN: every output is NaN.
    eqx_layernorm, eqx_residual_layernorm   the same lowering of ``jnp.var``'s guard ``where(N > ddof, var, NaN)``:
                               every output NaN in ONNX Runtime.
    eqx_embedding_layernorm    jax2tf's XLA-free gather under vmap fails: "Argument shape should be a valid JAX
                               shape but got (None, 2)".
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save_or_record, write_versions  # noqa: E402

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
from jax.experimental import jax2tf  # noqa: E402

H, S, B, V, OPSET = 32, 8, 2, 50, 17
rng = np.random.default_rng(SEED + 6)


class DenseNorm(nn.Module):
    norm: nn.Module
    residual: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(H)(x)
        return self.norm(h + x if self.residual else h)


class Embeddings(nn.Module):
    @nn.compact
    def __call__(self, ids):
        e = nn.Embed(V, H)(ids) + nn.Embed(S, H)(jnp.arange(ids.shape[1])[None, :])
        return nn.LayerNorm(epsilon=1e-12)(e)


class IndexedEmbeddings(nn.Module):
    """The lookups as ``jnp.take(table, ids, axis=0, mode="clip")`` instead of nn.Embed's default mode "fill"
    (out-of-range rows NaN, which tf2onnx's SelectV2 lowering turns into NaN everywhere)."""

    @nn.compact
    def __call__(self, ids):
        word = self.param("word", nn.initializers.normal(1.0), (V, H))
        position = self.param("position", nn.initializers.normal(1.0), (S, H))
        e = (jnp.take(word, ids, axis=0, mode="clip")
             + jnp.take(position, jnp.arange(ids.shape[1]), axis=0, mode="clip")[None])
        return nn.LayerNorm(epsilon=1e-12)(e)


def flax_fn(module, example):
    params = module.init(jax.random.PRNGKey(SEED), example)

    def perturb(path, p):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "Norm" in name and name.endswith("scale"):
            return jnp.asarray(perturbed(rng, p.shape, 1.0))
        if "Norm" in name and name.endswith("bias"):
            return jnp.asarray(perturbed(rng, p.shape, 0.0))
        return p
    params = jax.tree_util.tree_map_with_path(perturb, params)
    return lambda x: module.apply(params, x)


class EqxDenseNorm(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.Module
    residual: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        def row(v):
            h = self.dense(v)
            return self.norm(h + v if self.residual else h)
        return jax.vmap(jax.vmap(row))(x)


class EqxEmbeddings(eqx.Module):
    word: eqx.nn.Embedding
    position: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm

    def __call__(self, ids):
        def one(row):
            e = jax.vmap(self.word)(row) + jax.vmap(self.position)(jnp.arange(row.shape[0]))
            return jax.vmap(self.norm)(e)
        return jax.vmap(one)(ids)


def eqx_norm(norm):
    norm = eqx.tree_at(lambda n: n.weight, norm, jnp.asarray(perturbed(rng, norm.weight.shape, 1.0)))
    if getattr(norm, "bias", None) is not None:
        norm = eqx.tree_at(lambda n: n.bias, norm, jnp.asarray(perturbed(rng, norm.bias.shape, 0.0)))
    return norm


def convert(fn, shape, dtype, name, static: bool = False):
    """A symbolic batch, or (``static``) the batch of ``shape``: jax2tf's XLA-free gather with mode "clip" needs
    static shapes ("Argument shape should be a valid JAX shape but got (None, 2)")."""
    poly = None if static else "(b, " + ", ".join(str(d) for d in shape[1:]) + ")"
    spec = [tf.TensorSpec(shape if static else (None, *shape[1:]), dtype, name=name)]
    tf_fn = tf.function(jax2tf.convert(fn, native_serialization=False, enable_xla=False,
                                       polymorphic_shapes=[poly]), autograph=False, input_signature=spec)
    proto, _ = tf2onnx.convert.from_function(tf_fn, input_signature=spec, opset=OPSET)
    return proto


def main() -> None:
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    ids = rng.integers(0, V, (B, S)).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(SEED), 8)
    models = {
        "flax_layernorm": (flax_fn(DenseNorm(nn.LayerNorm()), xs), xs),
        "flax_rmsnorm": (flax_fn(DenseNorm(nn.RMSNorm()), xs), xs),
        "flax_residual_layernorm": (flax_fn(DenseNorm(nn.LayerNorm(epsilon=1e-12), residual=True), xs), xs),
        "flax_embedding_layernorm": (flax_fn(Embeddings(), ids), ids),
        "flax_indexed_embedding_layernorm": (flax_fn(IndexedEmbeddings(), ids), ids),
        "flax_channels_first": (flax_fn(nn.LayerNorm(reduction_axes=1, feature_axes=1), xc), xc),
        "eqx_layernorm": (EqxDenseNorm(eqx.nn.Linear(H, H, key=keys[0]), eqx_norm(eqx.nn.LayerNorm(H))), xs),
        "eqx_rmsnorm": (EqxDenseNorm(eqx.nn.Linear(H, H, key=keys[1]), eqx_norm(eqx.nn.RMSNorm(H))), xs),
        "eqx_residual_layernorm": (EqxDenseNorm(eqx.nn.Linear(H, H, key=keys[2]),
                                                eqx_norm(eqx.nn.LayerNorm(H, eps=1e-12)), residual=True), xs),
        "eqx_embedding_layernorm": (EqxEmbeddings(eqx.nn.Embedding(V, H, key=keys[3]),
                                                  eqx.nn.Embedding(S, H, key=keys[4]),
                                                  eqx_norm(eqx.nn.LayerNorm(H, eps=1e-12))), ids),
    }
    failed: dict[str, str] = {}
    for name, (fn, data) in models.items():
        expected = np.asarray(fn(jnp.asarray(data)))
        dtype = tf.int32 if data.dtype == np.int32 else tf.float32
        try:
            proto = convert(fn, data.shape, dtype, "input_ids" if dtype == tf.int32 else "x", static="indexed" in name)
        except Exception as exc:  # the converter itself fails: recorded, nothing written
            failed[name] = f"conversion fails: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"jax2tf/{name}: NOT KEPT: {failed[name]}", flush=True)
            continue
        save_or_record(failed, "jax2tf", name, proto, [data], expected)
    write_versions("jax2tf", {"jax": jax.__version__, "jaxlib": version("jaxlib"), "flax": version("flax"),
                              "equinox": version("equinox"), "tensorflow": tf.__version__,
                              "tf2onnx": tf2onnx.__version__}, failed)


if __name__ == "__main__":
    main()
