"""Does ONNX Runtime fold a DequantizeLinear of a constant embedding table when it loads a model? And what does a
run cost when it does not? (the table "A table dequantized whole" in docs/quantized.md)

    pip install -e . && python benchmarks/dequantized_tables.py

A BERT-base embedding block (30522 x 768 word table, 512 positions, 2 segments), batch 1, sequence 128, in three
forms: EmbedLayerNormalization over float tables; EmbedLayerNormalization over ``DequantizeLinear(uint8 table)``
(what writing the float kernel over quantized tables gives); a QDQ recipe's own lookups,
``DequantizeLinear(uint8 table) -> Gather`` and a LayerNormalization; QEmbedLayerNormalization over the uint8
tables. Each is
loaded with ONNX Runtime's default session options (all graph optimizations), the optimized graph written with
``SessionOptions.optimized_model_filepath`` to see whether the DequantizeLinear nodes are still there, and timed
(median of 50 runs after 5 warm-up runs, one intra-op thread).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
from onnx import TensorProto

VOCAB, POSITIONS, SEGMENTS, HIDDEN, BATCH, SEQ = 30522, 512, 2, 768, 1, 128
TABLES = (("word", VOCAB), ("position", POSITIONS), ("segment", SEGMENTS))


def _quantized(rng: np.random.Generator, name: str, rows: int) -> list[onnx.TensorProto]:
    return [onh.from_array(rng.integers(0, 256, (rows, HIDDEN), dtype=np.uint8), f"{name}_q"),
            onh.from_array(np.array(0.02, np.float32), f"{name}_scale"),
            onh.from_array(np.array(128, np.uint8), f"{name}_zero_point")]


def block(form: str) -> onnx.ModelProto:
    """The embedding block in one of the forms "float", "dequantized", "qdq_lookups", "qembed"."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    gamma_beta = [onh.from_array(rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), "gamma"),
                  onh.from_array(rng.normal(0, 0.1, HIDDEN).astype(np.float32), "beta")]
    if form == "float":
        inits = [onh.from_array(rng.normal(0, 0.05, (rows, HIDDEN)).astype(np.float32), name)
                 for name, rows in TABLES] + gamma_beta
        nodes.append(oh.make_node("EmbedLayerNormalization", ["ids", "segment_ids", "word", "position", "segment",
                                                              "gamma", "beta"], ["y"], domain="com.microsoft",
                                  epsilon=1e-12, mask_index_type=0))
    elif form == "dequantized":
        inits = [t for name, rows in TABLES for t in _quantized(rng, name, rows)] + gamma_beta
        nodes = [oh.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zero_point"], [name])
                 for name, _ in TABLES]
        nodes.append(oh.make_node("EmbedLayerNormalization", ["ids", "segment_ids", "word", "position", "segment",
                                                              "gamma", "beta"], ["y"], domain="com.microsoft",
                                  epsilon=1e-12, mask_index_type=0))
    elif form == "qdq_lookups":
        inits = [t for name, rows in TABLES for t in _quantized(rng, name, rows)] + gamma_beta
        inits.append(onh.from_array(np.arange(SEQ, dtype=np.int32), "position_ids"))
        nodes = [oh.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zero_point"], [name])
                 for name, _ in TABLES]
        nodes += [oh.make_node("Gather", [name, ids], [f"{name}_rows"])
                  for name, ids in zip(("word", "position", "segment"), ("ids", "position_ids", "segment_ids"))]
        nodes += [oh.make_node("Add", ["word_rows", "position_rows"], ["partial"]),
                  oh.make_node("Add", ["partial", "segment_rows"], ["sum"]),
                  oh.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], epsilon=1e-12)]
    else:
        inits = [t for name, rows in TABLES for t in _quantized(rng, name, rows)]
        for name in ("gamma", "beta"):
            inits += [onh.from_array(rng.integers(0, 256, HIDDEN, dtype=np.uint8), f"{name}_q"),
                      onh.from_array(np.array(0.01, np.float32), f"{name}_scale"),
                      onh.from_array(np.array(100, np.uint8), f"{name}_zero_point")]
        parts = [name for name, _ in TABLES] + ["gamma", "beta"]
        nodes.append(oh.make_node("QEmbedLayerNormalization",
                                  ["ids", "segment_ids"] + [f"{p}_q" for p in parts] + [""]
                                  + [f"{p}_scale" for p in parts] + [f"{p}_zero_point" for p in parts],
                                  ["y", "mask_index"], domain="com.microsoft", epsilon=1e-12))
    graph = oh.make_graph(nodes, form, [oh.make_tensor_value_info(n, TensorProto.INT32, [BATCH, SEQ])
                                        for n in ("ids", "segment_ids")],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model


def measure(form: str, tmp: Path) -> tuple[int, float]:
    """(DequantizeLinear nodes left after ORT's optimizations, median milliseconds per run)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp / f"{form}.optimized.onnx")
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(block(form).SerializeToString(), options, providers=["CPUExecutionProvider"])
    left = sum(n.op_type == "DequantizeLinear" for n in onnx.load(options.optimized_model_filepath).graph.node)
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32),
             "segment_ids": rng.integers(0, SEGMENTS, (BATCH, SEQ), dtype=np.int32)}
    for _ in range(5):
        session.run(None, feeds)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return left, statistics.median(times)


def main() -> None:
    print(f"onnxruntime {ort.__version__}, default session options, batch {BATCH}, sequence {SEQ}")
    print("| form | DequantizeLinear after load | ms per run |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for form, label in (("float", "EmbedLayerNormalization, float tables"),
                            ("dequantized", "EmbedLayerNormalization, DequantizeLinear(uint8 table)"),
                            ("qdq_lookups", "DequantizeLinear(uint8 table) -> Gather, LayerNormalization (QDQ)"),
                            ("qembed", "QEmbedLayerNormalization, uint8 tables")):
            left, ms = measure(form, Path(tmp))
            print(f"| {label} | {left} | {ms:.3f} |")


if __name__ == "__main__":
    main()
