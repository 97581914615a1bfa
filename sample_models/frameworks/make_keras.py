"""Keras 3 and tf-keras (Keras 2) through tf2onnx: the norm layers as Keras users write them.

Venv and versions (tensorflow-cpu 2.21.0 with keras 3.15.1, tf-keras 2.21.0, tf2onnx 1.17.0, onnx 1.23.2,
onnxruntime 1.32.0, numpy 2.4, protobuf 7.36); TensorFlow pins its own numpy/protobuf, hence its own venv:
    python -m venv /work/venv-tf && /work/venv-tf/bin/pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0 \\
        tf2onnx==1.17.0 onnxruntime
    /work/venv-tf/bin/python sample_models/frameworks/make_keras.py

``tf2onnx.convert.from_keras(model, input_signature, opset=17)``, batch dynamic. Hidden 32, sequence 8, batch 2;
every gamma/beta random (not 1/0).

keras3/ (``tf.keras`` is Keras 3 in TF 2.21; ``ops.layer_normalization`` is ``moments`` then
``x * (rsqrt(var + eps) * gamma) + (beta - mean * rsqrt(var + eps) * gamma)``):
    layernorm             Dense -> LayerNormalization() (epsilon 1e-3, Keras' default)
    rmsnorm               Dense -> keras.layers.RMSNormalization (x * rsqrt(mean(x²) + eps) * scale)
    rms_scaling           Dense -> LayerNormalization(rms_scaling=True): deprecated, and NOT an RMS norm: Keras 3
                          computes x * rsqrt(var + eps) * gamma with the *centred* variance and an uncentred x
                          (its own warning says so). Neither LayerNorm nor RMSNorm: a right fuser refuses it.
    residual_layernorm    Dense -> Add([x, h]) -> LayerNormalization(epsilon=1e-6) (post-norm)
    embedding_layernorm   Embedding(word)(ids) + Embedding(position)(arange(S)) -> LayerNormalization(1e-12)
    channels_first        LayerNormalization(axis=1) on [B, C, L] (gamma/beta reshaped to [1, C, 1])

tf_keras/ (``tf_keras``, Keras 2): LayerNormalization takes its *fused* path whenever the axes are the trailing ones,
epsilon >= 1.001e-5 and the dtype float32 (``_fused_can_be_used``), i.e. at the default epsilon 1e-3: the input is
reshaped to [1, rows, features, 1] and normalized by ``tf.compat.v1.nn.fused_batch_norm`` (training mode, unit
scale, zero offset), reshaped back, then ``* gamma + beta``. Below that epsilon it uses ``tf.nn.moments`` +
``tf.nn.batch_normalization``.
    layernorm             Dense -> LayerNormalization() (epsilon 1e-3: the fused BatchNormalization path)
    layernorm_eps1e-6     Dense -> LayerNormalization(epsilon=1e-6) (moments path)
    rmsnorm               Dense -> a custom layer: x * tf.math.rsqrt(reduce_mean(square(x)) + eps) * w
    residual_layernorm    Dense -> Add -> LayerNormalization() (fused path)
    embedding_layernorm   word + position Embedding -> LayerNormalization() (fused path)
    channels_first        LayerNormalization(axis=1) on [B, C, L] (not trailing: moments path)
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save, write_versions  # noqa: E402

import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

H, S, B, V, OPSET = 32, 8, 2, 50, 17
rng = np.random.default_rng(SEED + 5)


def randomize(model, norm_types) -> None:
    for layer in model.submodules if hasattr(model, "submodules") else model.layers:
        if isinstance(layer, norm_types):
            layer.set_weights([perturbed(rng, w.shape, 1.0 if i == 0 else 0.0)
                               for i, w in enumerate(layer.get_weights())])


def export(framework: str, name: str, model, specs, data, norm_types) -> None:
    randomize(model, norm_types)
    expected = np.asarray(model(data))
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=specs, opset=OPSET)
    save(framework, name, proto, [data], expected)


def keras3_models(xs, xc, ids) -> None:
    keras = tf.keras
    ops = keras.ops
    assert keras.__version__.startswith("3."), keras.__version__
    norms = (keras.layers.LayerNormalization, keras.layers.RMSNormalization)
    f32 = (tf.TensorSpec((None, S, H), tf.float32, name="x"),)

    def dense_then(norm):
        x = keras.Input((S, H), name="x")
        return keras.Model(x, norm(keras.layers.Dense(H)(x)))

    keras.utils.set_random_seed(SEED)
    export("keras3", "layernorm", dense_then(keras.layers.LayerNormalization()), f32, xs, norms)
    export("keras3", "rmsnorm", dense_then(keras.layers.RMSNormalization(epsilon=1e-6)), f32, xs, norms)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rms_scaling = keras.layers.LayerNormalization(rms_scaling=True)
    export("keras3", "rms_scaling", dense_then(rms_scaling), f32, xs, norms)

    x = keras.Input((S, H), name="x")
    h = keras.layers.Dense(H)(x)
    y = keras.layers.LayerNormalization(epsilon=1e-6)(keras.layers.Add()([x, h]))
    export("keras3", "residual_layernorm", keras.Model(x, y), f32, xs, norms)

    class Embeddings(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.word = keras.layers.Embedding(V, H)
            self.position = keras.layers.Embedding(S, H)
            self.norm = keras.layers.LayerNormalization(epsilon=1e-12)

        def call(self, ids):
            positions = ops.arange(ops.shape(ids)[1])
            return self.norm(self.word(ids) + self.position(positions)[None])

    i = keras.Input((S,), dtype="int32", name="input_ids")
    model = keras.Model(i, Embeddings()(i))
    export("keras3", "embedding_layernorm", model, (tf.TensorSpec((None, S), tf.int32, name="input_ids"),), ids,
           norms)

    x = keras.Input((H, S), name="x")
    model = keras.Model(x, keras.layers.LayerNormalization(axis=1)(x))
    export("keras3", "channels_first", model, (tf.TensorSpec((None, H, S), tf.float32, name="x"),), xc, norms)
    write_versions("keras3", {"tensorflow": tf.__version__, "keras": keras.__version__,
                              "tf2onnx": tf2onnx.__version__})


def tf_keras_models(xs, xc, ids) -> None:
    import tf_keras as keras

    class RMSNorm(keras.layers.Layer):
        def build(self, input_shape):
            self.weight = self.add_weight("weight", (input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6) * self.weight

    norms = (keras.layers.LayerNormalization, RMSNorm)
    f32 = (tf.TensorSpec((None, S, H), tf.float32, name="x"),)

    def dense_then(norm):
        x = keras.Input((S, H), name="x")
        return keras.Model(x, norm(keras.layers.Dense(H)(x)))

    keras.utils.set_random_seed(SEED)
    fused = keras.layers.LayerNormalization()
    export("tf_keras", "layernorm", dense_then(fused), f32, xs, norms)
    assert fused._fused, "the default LayerNormalization takes the fused path"
    moments = keras.layers.LayerNormalization(epsilon=1e-6)
    export("tf_keras", "layernorm_eps1e-6", dense_then(moments), f32, xs, norms)
    assert not moments._fused
    export("tf_keras", "rmsnorm", dense_then(RMSNorm()), f32, xs, norms)

    x = keras.Input((S, H), name="x")
    h = keras.layers.Dense(H)(x)
    y = keras.layers.LayerNormalization()(keras.layers.Add()([x, h]))
    export("tf_keras", "residual_layernorm", keras.Model(x, y), f32, xs, norms)

    class Embeddings(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.word = keras.layers.Embedding(V, H)
            self.position = keras.layers.Embedding(S, H)
            self.norm = keras.layers.LayerNormalization()

        def call(self, ids):
            positions = tf.range(tf.shape(ids)[1])
            return self.norm(self.word(ids) + self.position(positions)[None])

    i = keras.Input((S,), dtype="int32", name="input_ids")
    model = keras.Model(i, Embeddings()(i))
    export("tf_keras", "embedding_layernorm", model, (tf.TensorSpec((None, S), tf.int32, name="input_ids"),), ids,
           norms)

    x = keras.Input((H, S), name="x")
    model = keras.Model(x, keras.layers.LayerNormalization(axis=1)(x))
    export("tf_keras", "channels_first", model, (tf.TensorSpec((None, H, S), tf.float32, name="x"),), xc, norms)
    write_versions("tf_keras", {"tensorflow": tf.__version__, "tf_keras": version("tf_keras"),
                                "tf2onnx": tf2onnx.__version__})


def main() -> None:
    xs = rng.standard_normal((B, S, H)).astype(np.float32)
    xc = rng.standard_normal((B, H, S)).astype(np.float32)
    ids = rng.integers(0, V, (B, S)).astype(np.int32)
    keras3_models(xs, xc, ids)
    tf_keras_models(xs, xc, ids)


if __name__ == "__main__":
    main()
