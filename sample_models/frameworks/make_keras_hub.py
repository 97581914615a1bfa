"""keras-hub backbones and Keras 3 embedding layers, exported by Keras 3's own ``model.export(path, format="onnx")``
(issue 28): the position embedding that slices its table, and LayerNorms that share their statistics.

Venv and versions: tensorflow-cpu 2.21.0 with keras 3.15.1, keras-hub 0.32.0, tf2onnx 1.17.0, onnx 1.23.2,
onnxruntime 1.32.0 (keras-hub pulls tensorflow-text 2.21.1); JAX: jax/jaxlib 0.10.2, jax2onnx 0.17.1, the same
keras and keras-hub:
    python -m venv /work/venv-tf && /work/venv-tf/bin/pip install tensorflow-cpu==2.21.0 keras==3.15.1 \\
        keras-hub==0.32.0 tf2onnx==1.17.0 onnxruntime
    /work/venv-tf/bin/python sample_models/frameworks/make_keras_hub.py tensorflow
    python -m venv /work/venv-kjax && /work/venv-kjax/bin/pip install jax keras==3.15.1 keras-hub==0.32.0 \\
        jax2onnx==0.17.1 onnxruntime
    /work/venv-kjax/bin/python sample_models/frameworks/make_keras_hub.py jax
    /work/venv-kjax/bin/pip install torch==2.13.0 onnxscript      # torch 2.13.0+cpu, onnxscript 0.7.2
    /work/venv-kjax/bin/python sample_models/frameworks/make_keras_hub.py torch

Keras exports through tf2onnx on TensorFlow (opset 15, its default), through jax2onnx on JAX and through torch's
dynamo exporter on torch. Random weights, tiny configs: vocabulary 100, hidden 32, 2 heads, intermediate 64,
max_sequence_length 16; the sample batch is 2 x 8. TensorFlow: batch and sequence dynamic (Keras' own signature);
JAX and torch: batch and sequence fixed at 2 x 8 (see ``_signature``). Every LayerNorm's gamma/beta is random (not
1/0). Files are ``<backend>_<name>.onnx`` with the usual npz (``_common.py``); ``expected`` is Keras' own
``sequence_output``.

    bert          BertBackbone, 1 layer: token + PositionEmbedding + segment, then LayerNorm. PositionEmbedding is
                  ``broadcast_to(slice(table, (0, 0), (S, H)), shape(x))`` with S = shape(x)[-2]: no position ids.
    gpt2          GPT2Backbone, 1 layer: token + PositionEmbedding; the sum goes to the first pre-norm and the residual.
    gpt_neox      GPTNeoXBackbone, 2 layers (parallel residual): each layer normalizes one input twice (attention and
                  MLP norms), and the exporter computes the statistics once for both (5 norms, 3 statistics).
    token_and_position   keras_hub.layers.TokenAndPositionEmbedding -> LayerNorm (the layer on its own).
Near-misses (a custom Keras layer slicing the table otherwise; must NOT become an embedding with 0..S-1):
    position_offset      table[1 : S + 1]           (start 1)
    position_step2       table[0 : 2S : 2]          (step 2)
    position_fixed_end   table[0 : 8]               (end a constant 8, where S is dynamic)
    position_axis1       table [H, max] sliced [:, :S], transposed (the positions run along axis 1)
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "tensorflow"
os.environ["KERAS_BACKEND"] = BACKEND
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEED, perturbed, save_or_record, write_versions  # noqa: E402

import keras  # noqa: E402
import keras_hub  # noqa: E402
import onnx  # noqa: E402
from keras import ops  # noqa: E402

V, H, HEADS, FF, MAX, B, S = 100, 32, 2, 64, 16, 2, 8
FOLDER = "keras_hub"
PREFIX = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}[BACKEND]
rng = np.random.default_rng(SEED + 28)
failed: dict[str, str] = {}


def randomize_norms(model) -> None:
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.LayerNormalization):
            layer.set_weights([perturbed(rng, w.shape, 1.0 if i == 0 else 0.0)
                               for i, w in enumerate(layer.get_weights())])


def export(name: str, model, data: dict[str, np.ndarray]) -> None:
    randomize_norms(model)
    expected = np.asarray(ops.convert_to_numpy(model(data)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        try:
            model.export(path, format="onnx", verbose=False, input_signature=_signature(model, data))
        except Exception as exc:  # recorded in versions.json, not kept
            said = " ".join(line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()
                            if line.strip())
            failed[f"{PREFIX}_{name}"] = f"{type(exc).__name__}: {said[:300]}"
            print(f"{PREFIX}_{name}: NOT EXPORTED: {failed[f'{PREFIX}_{name}']}", flush=True)
            return
        proto = onnx.load(path)
    inits = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    save_or_record(failed, FOLDER, f"{PREFIX}_{name}", proto, [data[n] for n in names], expected)


def _signature(model, data: dict[str, np.ndarray]):
    """None (Keras' own: batch and sequence dynamic) on TensorFlow. On JAX both are fixed (B x S): with a dynamic
    sequence keras-hub's PositionEmbedding compares it with the table's length, which jax's symbolic shapes cannot
    decide ("Symbolic dimension comparison 'dim_2_1' <= '16' is inconclusive"), and with a dynamic batch jax2onnx
    0.17.1 writes an Expand that ONNX Runtime refuses ("invalid expand shape"). On torch too: a dynamic dim sends
    Keras to torch's TorchScript exporter, which fails on keras.ops.layer_normalization ("Failed to export a node
    ... because it is not constant"); static shapes take the dynamo exporter."""
    if BACKEND == "tensorflow":
        return None
    specs = {k: keras.InputSpec(shape=(B, S), dtype="int32", name=k) for k in data}
    names = [t.name for t in keras.tree.flatten(model.inputs)]
    return [specs] if isinstance(model.input, dict) else [specs[names[0]]] if len(specs) == 1 else [specs]


def sequence_output(backbone):
    return keras.Model(backbone.input, backbone.output["sequence_output"])


def text_data(segments: bool) -> dict[str, np.ndarray]:
    data = {"token_ids": rng.integers(0, V, (B, S)).astype("int32"),
            "padding_mask": np.ones((B, S), "int32")}
    if segments:
        data["segment_ids"] = rng.integers(0, 2, (B, S)).astype("int32")
    return data


class SlicedPositions(keras.layers.Layer):
    """A position embedding that slices its table as ``how`` says, broadcast over the batch like keras-hub's."""

    def __init__(self, how: str, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def build(self, input_shape):
        shape = (H, MAX) if self.how == "axis1" else (MAX, H)
        self.table = self.add_weight(shape=shape, initializer="random_normal", name="table")

    def call(self, x):
        seq = ops.shape(x)[-2]
        table = ops.convert_to_tensor(self.table)
        if self.how == "offset":
            rows = ops.slice(table, (1, 0), (seq, H))
        elif self.how == "step2":
            rows = table[0:2 * seq:2]
        elif self.how == "fixed_end":
            rows = ops.slice(table, (0, 0), (S, H))
        else:
            rows = ops.transpose(ops.slice(table, (0, 0), (H, seq)))
        return ops.broadcast_to(rows, ops.shape(x))


def embedding_model(positions) -> keras.Model:
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    words = keras.layers.Embedding(V, H)(ids)
    summed = positions(words) if positions is not None else words
    if positions is not None and not isinstance(positions, keras_hub.layers.TokenAndPositionEmbedding):
        summed = keras.layers.Add()([words, summed])
    return keras.Model(ids, keras.layers.LayerNormalization(epsilon=1e-12)(summed))


def main() -> None:
    keras.utils.set_random_seed(SEED + 28)
    common = dict(vocabulary_size=V, num_heads=HEADS, hidden_dim=H, intermediate_dim=FF, max_sequence_length=MAX)
    export("bert", sequence_output(keras_hub.models.BertBackbone(num_layers=1, num_segments=2, **common)),
           text_data(True))
    export("gpt2", keras_hub.models.GPT2Backbone(num_layers=1, **common), text_data(False))
    export("gpt_neox", keras_hub.models.GPTNeoXBackbone(num_layers=2, **common), text_data(False))
    ids = {"token_ids": rng.integers(0, V, (B, S)).astype("int32")}
    tp = keras.Input((None,), dtype="int32", name="token_ids")
    summed = keras_hub.layers.TokenAndPositionEmbedding(V, MAX, H)(tp)
    export("token_and_position", keras.Model(tp, keras.layers.LayerNormalization(epsilon=1e-12)(summed)), ids)
    # the near-misses are TensorFlow's (tf2onnx keeps the Slice); on JAX a custom layer's ops.slice of a symbolic
    # sequence cannot even be traced into a functional model
    for how in ("offset", "step2", "fixed_end", "axis1") if BACKEND == "tensorflow" else ():
        export(f"position_{how}", embedding_model(SlicedPositions(how)), ids)
    versions = {"keras": keras.__version__, "keras_hub": keras_hub.__version__}
    if BACKEND == "tensorflow":
        import tensorflow as tf
        import tf2onnx
        versions |= {"tensorflow": tf.__version__, "tf2onnx": tf2onnx.__version__}
    elif BACKEND == "jax":
        import jax
        import jax2onnx
        versions |= {"jax": jax.__version__, "jax2onnx": getattr(jax2onnx, "__version__", "0.17.1")}
    else:
        import onnxscript
        import torch
        versions |= {"torch": torch.__version__, "torch_onnxscript": onnxscript.__version__}
    write_versions(FOLDER, versions | _previous_versions(), failed)


def _previous_versions() -> dict[str, str]:
    """The other backends' entries of versions.json: each backend's run adds its own."""
    import json
    path = Path(__file__).resolve().parent / FOLDER / "versions.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    return {k: v for k, v in old.items() if k.startswith(("jax", "tf", "tensorflow", "torch", "not kept"))
            and not k.startswith(f"not kept: {PREFIX}_")}


if __name__ == "__main__":
    main()
