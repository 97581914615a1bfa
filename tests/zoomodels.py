"""Models for many-model runs (tests/test_zoo.py and benchmarks/zoo.py): copies of the sample models, and the
ones that must fail alone: a hostile folder, a model slower than any timeout a test sets, a model whose
verification needs gigabytes, an external-data model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import set_external_data

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
#: small, quick sample models that fuse fully (their outputs are compared with single runs)
QUICK = ("bert_tiny_legacy_op14.onnx", "sam_neck_legacy_op14.onnx", "convnext_tiny_legacy_op17.onnx",
         "llama_tiny_legacy_op14.onnx", "keras_encoder_tf2onnx_op17.onnx", "hf_swin_dynamo_op18.onnx")


def copy_samples(folder: Path, names=QUICK) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(SAMPLES / name, folder / name)) for name in names]


def layer_norm_chain(path: Path, norms: int, hidden: int = 64, shape: list | None = None) -> Path:
    """``norms`` decomposed LayerNorms one after another: each is a candidate lnfuse verifies, so the time to fuse
    grows with ``norms`` (about 2,000 take 10 s on one core). With a static ``shape`` as large as verification
    allows, verifying even one needs gigabytes."""
    shape = shape or ["batch", "sequence", hidden]
    nodes, weights = [], [numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
                          numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    x = "x"
    rng = np.random.default_rng(0)
    for i in range(norms):
        weights += [numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), f"gamma{i}"),
                    numpy_helper.from_array(rng.uniform(-0.1, 0.1, hidden).astype(np.float32), f"beta{i}")]
        p = f"n{i}_"
        nodes += [oh.make_node("ReduceMean", [x], [p + "mean"], axes=[-1]),
                  oh.make_node("Sub", [x, p + "mean"], [p + "d"]),
                  oh.make_node("Pow", [p + "d", "two"], [p + "sq"]),
                  oh.make_node("ReduceMean", [p + "sq"], [p + "var"], axes=[-1]),
                  oh.make_node("Add", [p + "var", "eps"], [p + "var_eps"]),
                  oh.make_node("Sqrt", [p + "var_eps"], [p + "std"]),
                  oh.make_node("Div", [p + "d", p + "std"], [p + "normed"]),
                  oh.make_node("Mul", [p + "normed", f"gamma{i}"], [p + "scaled"]),
                  oh.make_node("Add", [p + "scaled", f"beta{i}"], [p + "out"])]
        x = p + "out"
    graph = oh.make_graph(nodes, "layer_norm_chain", [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [oh.make_tensor_value_info(x, TensorProto.FLOAT, shape)], weights)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def slow_model(path: Path, norms: int = 6000) -> Path:
    """A model that takes far longer than any --timeout a test sets (about 30 s at 6,000 norms)."""
    return layer_norm_chain(path, norms)


def memory_hog(path: Path) -> Path:
    """One LayerNorm on a static [16, 4096, 1024] float input: verifying it allocates about 5 GB (inputs at the
    256 MB verification budget and ONNX Runtime's intermediates); a 1 GB --max-memory stops it in seconds."""
    return layer_norm_chain(path, 1, hidden=1024, shape=[16, 4096, 1024])


def external_model(folder: Path, name: str = "ext.onnx", data: str = "ext.data") -> Path:
    """A LayerNorm chain whose weights are external data in ``data`` beside it."""
    path = layer_norm_chain(folder / name, 2, hidden=256)
    model = onnx.load(path)
    offset, blob = 0, b""
    for tensor in model.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        if len(raw) < 64:
            continue
        set_external_data(tensor, data, offset, len(raw))
        tensor.ClearField("raw_data")
        tensor.ClearField("float_data")
        tensor.data_location = TensorProto.EXTERNAL
        blob += raw
        offset += len(raw)
    (folder / data).write_bytes(blob)
    path.write_bytes(model.SerializeToString())
    return path


def hostile_folder(folder: Path, outside: Path) -> list[Path]:
    """A folder of models that must be refused: external data through a link to a file outside the folder,
    external data named by an absolute path, and a file that is not ONNX at all."""
    folder.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "secret.data").write_bytes(b"\0" * 4096)
    linked = external_model(folder, "linked.onnx", "linked.data")
    (folder / "linked.data").unlink()
    (folder / "linked.data").symlink_to(outside / "secret.data")
    absolute = external_model(folder, "absolute.onnx", "absolute.data")
    model = onnx.load(absolute, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str(outside / "secret.data")
    absolute.write_bytes(model.SerializeToString())
    garbage = folder / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07" + b"\xff" * 100)
    return [linked, absolute, garbage]
