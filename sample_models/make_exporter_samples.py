"""Regenerate the sample ONNX models written by other exporters than the ones ``make_samples.py`` uses.

Each file is what a real exporter writes for a tiny, randomly initialised model; the norms in them are
spelled as those exporters spell them, which is what the tests and ``benchmarks/compare.py`` measure lnfuse on.

tf2onnx (run with a TensorFlow venv, see below):

* ``keras_encoder_tf2onnx_op13.onnx`` / ``_op17``  a Keras model: Dense, LayerNormalization, then a transformer
  encoder block (MultiHeadAttention + residual + LayerNormalization, feed-forward + residual + LayerNormalization).
  tf2onnx writes each mean as ``GlobalAveragePool`` of the rank-3 activation and folds the affine as
  ``x·k + (Neg(mean)·k + beta)`` with ``k = gamma / sqrt(var + eps)``.

torch 2.13, hand-written channels-first norms over axis 1 of NCHW (``u = x.mean(1, keepdim=True)`` ...,
``w[:, None, None] * x + b[:, None, None]``, the code of Detectron2/ViTDet, Segment Anything's LayerNorm2d and
the original ConvNeXt), each from the TorchScript exporter at opsets 14 and 17 and from dynamo at opset 18:

* ``sam_neck_{legacy_op14,legacy_op17,dynamo_op18}.onnx``  SAM's image-encoder neck: Conv 1x1 → LayerNorm2d →
  Conv 3x3 → LayerNorm2d.
* ``convnext_tiny_{legacy_op14,legacy_op17,dynamo_op18}.onnx``  the original ConvNeXt code: stem Conv +
  channels_first LayerNorm, a block (depthwise Conv → permute → channels_last LayerNorm → MLP → layer scale →
  permute, + residual), a downsampling channels_first LayerNorm + Conv, a second block, a final norm.

Hugging Face transformers 5.23, from tiny random configs:

* ``hf_swin_{legacy_op17,dynamo_op18}.onnx``  SwinModel (residual + LayerNorm on [B, H·W, C]).
* ``hf_vitdet_{legacy_op17,dynamo_op18}.onnx``  VitDetModel with a residual bottleneck block: its residual norms
  act on [B, H, W, C] (rank 4), and the bottleneck block uses VitDetLayerNorm (channels-first).

onnxscript 0.7's code-form test models (``onnxscript/rewriter/models``: SmolLM, Phi-2, Phi-4, Whisper encoder and
decoder) are 12 MB to 6.8 GB, too big to commit: ``onnxscript_model(name, folder)`` writes one as onnxscript
builds it (every constant a ``CastLike``, weights as ``Constant`` nodes), with the weights over 64 KiB in an
external data file that is sparse (zeros, no disk space) so that even Phi-4 costs nothing to make. The tests and
the benchmark call it.

Every norm's weight and bias is moved off 1/0, so that a wrong fusion shows up numerically. After exporting, each
committed file passes ``onnx.checker.check_model(full_check=True)`` and runs in ONNX Runtime (graph optimizations
off) on a batch other than the export's, agreeing with the framework's own output.

Run from the repo root:
    python sample_models/make_exporter_samples.py                          # torch 2.13, transformers 5.23
    python -m venv /tmp/venv-tf && /tmp/venv-tf/bin/pip install tensorflow-cpu==2.21.0 tf2onnx==1.17.0 \\
        onnxruntime==1.32.0
    /tmp/venv-tf/bin/python sample_models/make_exporter_samples.py keras    # TF 2.21 (Keras 3.15), tf2onnx 1.17
TensorFlow pins its own numpy/protobuf, hence its own venv (without system site packages).
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

# The dynamo exporter logs one warning per torchvision op it cannot register.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

OUT_DIR = Path(__file__).resolve().parent
# ORT 1.31 refuses IR versions it does not know; every sample here is written at IR 10 (as make_samples.py does).
MAX_IR_VERSION = 10
HIDDEN = 16
CHECK_BATCH = 2
EXPORT_BATCH = 3


def finish(proto: onnx.ModelProto, name: str, inputs: dict[str, np.ndarray], expected: np.ndarray,
           tol: float = 1e-4) -> None:
    """Save, then check the saved file: full checker, ORT (optimizations off) agrees with the framework."""
    import onnxruntime as ort

    for nodes in [proto.graph.node] + [f.node for f in proto.functions]:
        for node in nodes:  # dynamo's stack traces hold absolute paths
            kept = [p for p in node.metadata_props if "stack_trace" not in p.key]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    path = OUT_DIR / name
    onnx.save_model(proto, str(path))
    saved = onnx.load(str(path))
    onnx.checker.check_model(saved, full_check=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = sess.run(None, inputs)[0]
    err = float(np.abs(got.astype(np.float64) - expected).max())
    if not np.isfinite(got).all() or err > tol:
        raise AssertionError(f"{name}: ORT differs from the framework by {err}")
    counts: dict[str, int] = {}
    for node in saved.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    norm_ops = {k: v for k, v in counts.items()
                if k in ("ReduceMean", "GlobalAveragePool", "LayerNormalization", "Sqrt")}
    print(f"{name:40} nodes {len(saved.graph.node):4}  {norm_ops}  max|ort-ref| {err:.1e}  "
          f"{path.stat().st_size / 1024:.0f} kB", flush=True)


# =========================================================================== tf2onnx / Keras


def keras_samples() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tf2onnx

    keras = tf.keras
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, tf2onnx {tf2onnx.__version__}")
    seq = 6
    for opset in (13, 17):
        keras.utils.set_random_seed(20 + opset)
        x = keras.Input((seq, HIDDEN), name="x")
        h = keras.layers.Dense(HIDDEN)(x)
        h = keras.layers.LayerNormalization(epsilon=1e-3)(h)  # Keras' default epsilon
        attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=HIDDEN // 2)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-6)(h + attn)
        ffn = keras.layers.Dense(HIDDEN)(keras.layers.Dense(2 * HIDDEN, activation="relu")(h))
        h = keras.layers.LayerNormalization(epsilon=1e-6)(h + ffn)
        model = keras.Model(x, h)
        rng = np.random.default_rng(opset)
        for layer in model.layers:
            if isinstance(layer, keras.layers.LayerNormalization):
                gamma, beta = layer.get_weights()
                layer.set_weights([rng.normal(1.0, 0.2, gamma.shape).astype(np.float32),
                                   rng.normal(0.0, 0.2, beta.shape).astype(np.float32)])
        spec = (tf.TensorSpec((None, seq, HIDDEN), tf.float32, name="x"),)
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=opset)
        inputs = {"x": rng.standard_normal((CHECK_BATCH, seq, HIDDEN)).astype(np.float32)}
        expected = model(inputs["x"]).numpy()
        finish(proto, f"keras_encoder_tf2onnx_op{opset}.onnx", inputs, expected)


# =========================================================================== torch: channels-first norms


def torch_modules():
    """The hand-written modules, defined where torch is importable (the keras run has no torch)."""
    import torch
    from torch import nn

    class LayerNorm2d(nn.Module):
        """Segment Anything's LayerNorm2d (also Detectron2's and ViTDet's): a LayerNorm over axis 1 of NCHW."""

        def __init__(self, channels: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            x = (x - u) / torch.sqrt(s + self.eps)
            x = self.weight[:, None, None] * x + self.bias[:, None, None]
            return x

    class ConvNeXtLayerNorm(nn.Module):
        """The original ConvNeXt code's LayerNorm: F.layer_norm for channels_last, written out for channels_first."""

        def __init__(self, channels: int, eps: float = 1e-6, data_format: str = "channels_last") -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))
            self.eps = eps
            self.data_format = data_format
            self.normalized_shape = (channels,)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.data_format == "channels_last":
                return nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            x = (x - u) / torch.sqrt(s + self.eps)
            x = self.weight[:, None, None] * x + self.bias[:, None, None]
            return x

    class SamNeck(nn.Module):
        """SAM's ImageEncoderViT neck."""

        def __init__(self, dim: int = HIDDEN, out: int = 8) -> None:
            super().__init__()
            self.neck = nn.Sequential(nn.Conv2d(dim, out, 1, bias=False), LayerNorm2d(out),
                                      nn.Conv2d(out, out, 3, padding=1, bias=False), LayerNorm2d(out))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.neck(x)

    class ConvNeXtBlock(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
            self.norm = ConvNeXtLayerNorm(dim)
            self.pwconv1 = nn.Linear(dim, 4 * dim)
            self.act = nn.GELU()
            self.pwconv2 = nn.Linear(4 * dim, dim)
            self.gamma = nn.Parameter(0.5 * torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shortcut = x
            x = self.dwconv(x)
            x = x.permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
            x = self.norm(x)
            x = self.pwconv2(self.act(self.pwconv1(x)))
            x = self.gamma * x
            x = x.permute(0, 3, 1, 2)
            return shortcut + x

    class TinyConvNeXt(nn.Module):
        def __init__(self, dims: tuple[int, int] = (8, HIDDEN)) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4),
                                      ConvNeXtLayerNorm(dims[0], data_format="channels_first"))
            self.stage1 = ConvNeXtBlock(dims[0])
            self.down = nn.Sequential(ConvNeXtLayerNorm(dims[0], data_format="channels_first"),
                                      nn.Conv2d(dims[0], dims[1], kernel_size=2, stride=2))
            self.stage2 = ConvNeXtBlock(dims[1])
            self.norm = nn.LayerNorm(dims[1], eps=1e-6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stage2(self.down(self.stage1(self.stem(x))))
            return self.norm(x.mean([-2, -1]))  # global average pooling, (N, C, H, W) -> (N, C)

    return SamNeck, TinyConvNeXt


def randomize_norms(model) -> int:
    """Move every norm's weight and bias off 1/0 (a fusion that drops or swaps them must show)."""
    import torch

    count = 0
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if "LayerNorm" in name or "Norm2d" in name:
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
                count += 1
    if not count:
        raise AssertionError(f"no norm in {type(model).__name__}")
    return count


def export(model, example, exporter: str, opset: int, input_name: str, output_name: str) -> onnx.ModelProto:
    """TorchScript ("legacy") or dynamo export with a dynamic batch; the rest of the shape as exported."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            buffer = io.BytesIO()
            torch.onnx.export(model, (example,), buffer, dynamo=False, opset_version=opset,
                              input_names=[input_name], output_names=[output_name],
                              dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}})
            return onnx.load_from_string(buffer.getvalue())
        program = torch.onnx.export(model, (example,), dynamo=True, opset_version=opset, verbose=False,
                                    input_names=[input_name], output_names=[output_name],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},))
        return program.model_proto


EXPORTS = (("legacy", 14), ("legacy", 17), ("dynamo", 18))


def channels_first_samples() -> None:
    import torch

    sam_neck, tiny_convnext = torch_modules()
    for stem, build, shape in (("sam_neck", sam_neck, (HIDDEN, 8, 8)), ("convnext_tiny", tiny_convnext, (3, 32, 32))):
        for exporter, opset in EXPORTS:
            torch.manual_seed(30)
            model = build().eval()
            randomize_norms(model)
            example = torch.randn(EXPORT_BATCH, *shape)
            proto = export(model, example, exporter, opset, "x", "y")
            x = torch.randn(CHECK_BATCH, *shape)
            with torch.no_grad():
                expected = model(x).numpy()
            finish(proto, f"{stem}_{exporter}_op{opset}.onnx", {"x": x.numpy()}, expected)


# =========================================================================== transformers: Swin and ViTDet


def hf_vision_samples() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from torch import nn

    class LastHiddenState(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            out = self.model(pixel_values=pixel_values, return_dict=True)
            return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.feature_maps[-1]

    def swin() -> nn.Module:
        config = transformers.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=HIDDEN,
                                         depths=[2, 1], num_heads=[2, 2], window_size=4, mlp_ratio=2.0,
                                         attn_implementation="eager")
        return transformers.SwinModel(config, add_pooling_layer=False)

    def vitdet() -> nn.Module:
        config = transformers.VitDetConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                           mlp_ratio=2, image_size=32, pretrain_image_size=32, patch_size=8,
                                           residual_block_indices=[1], out_features=["stage2"],
                                           attn_implementation="eager")
        return transformers.VitDetBackbone(config)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for stem, build in (("hf_swin", swin), ("hf_vitdet", vitdet)):
        for exporter, opset in (("legacy", 17), ("dynamo", 18)):
            torch.manual_seed(40)
            model = LastHiddenState(build()).eval()
            randomize_norms(model)
            proto = export(model, torch.randn(EXPORT_BATCH, 3, 32, 32), exporter, opset, "pixel_values",
                           "last_hidden_state")
            x = torch.randn(CHECK_BATCH, 3, 32, 32)
            with torch.no_grad():
                expected = model(x).numpy()
            finish(proto, f"{stem}_{exporter}_op{opset}.onnx", {"pixel_values": x.numpy()}, expected)


# =========================================================================== onnxscript's code-form models

ONNXSCRIPT_MODELS = ("_smollm_1", "_phi2lm", "_phi4lm", "_whisper_encoder", "_whisper_decoder")
# Weights up to this size stay inline with random values (norm weights, biases, small tables); bigger ones go to
# the sparse external data file as zeros.
INLINE_BYTES = 64 * 1024


class _SparseWeights:
    """Stands in for numpy inside an onnxscript model module: ``random.rand(*shape).astype(dtype)`` gives random
    values for small weights and, for big ones, an external tensor in a sparse file (zeros that take no disk)."""

    def __init__(self, data_path: Path, seed: int, inline_bytes: int) -> None:
        self._data_path = data_path
        self._inline_bytes = inline_bytes
        self._rng = np.random.default_rng(seed)
        self._offset = 0
        self.random = self  # the modules call np.random.rand / np.random.seed

    def __getattr__(self, name: str):
        return getattr(np, name)

    def seed(self, _seed: int) -> None:
        pass  # our own generator is seeded

    def rand(self, *shape: int) -> "_Weight":
        return _Weight(self, shape)

    def weight(self, shape: tuple[int, ...], dtype) -> object:
        import onnx_ir as ir

        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if size <= self._inline_bytes:
            return self._rng.random(shape).astype(dtype)
        offset = self._offset
        self._offset += size + (-size) % 4096  # page-aligned, as onnx writes external data
        with open(self._data_path, "ab") as f:
            f.truncate(self._offset)
        return ir.ExternalTensor(self._data_path.name, offset, size, ir.DataType.from_numpy(dtype),
                                 shape=ir.Shape(shape), name=f"w{offset}", base_dir=self._data_path.parent)


class _Weight:
    def __init__(self, weights: _SparseWeights, shape: tuple[int, ...]) -> None:
        self._weights, self._shape = weights, shape

    def astype(self, dtype):
        return self._weights.weight(self._shape, dtype)


def onnxscript_model(name: str, folder: Path, seed: int = 0, inline_bytes: int = INLINE_BYTES) -> Path:
    """Write onnxscript's test model ``name`` (one of ONNXSCRIPT_MODELS) to ``folder/<name>.onnx``, as onnxscript
    builds it: every weight a Constant node, those over ``inline_bytes`` with their tensor in a sparse
    ``<name>.data`` beside it (zeros)."""
    module = importlib.import_module(f"onnxscript.rewriter.models.{name}")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name.lstrip('_')}.data"
    data.unlink(missing_ok=True)
    data.touch()
    fake = _SparseWeights(data, seed, inline_bytes)
    saved = {attr: getattr(module, attr) for attr in ("np", "numpy") if hasattr(module, attr)}
    try:
        for attr in saved:
            setattr(module, attr, fake)
        proto = module.make_model_with_random_weights()
    finally:
        for attr, value in saved.items():
            setattr(module, attr, value)
    path = folder / f"{name.lstrip('_')}.onnx"
    onnx.save_model(proto, str(path))
    return path


# =========================================================================== main


def main(argv: list[str]) -> None:
    if argv[:1] == ["keras"]:
        keras_samples()
        return
    channels_first_samples()
    hf_vision_samples()


if __name__ == "__main__":
    main(sys.argv[1:])
