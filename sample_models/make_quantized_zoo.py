"""The quantized zoo (issue 28): three float sample models run through every recipe users apply to shrink them with
ONNX Runtime's own tools, so that the next quantizer spelling is met in lnfuse's tests first.

    pip install onnxruntime==1.32.0 onnx==1.23.2 numpy==2.4.6 && python sample_models/make_quantized_zoo.py

(no torch: the sources are the committed float exports). Writes ``quantized/<model>__<recipe>.onnx`` next to this
file, from bert_tiny_legacy_op14 (post-norm LayerNorm encoder), gpt2_tiny_legacy_op14 (pre-norm LayerNorm decoder)
and llama_tiny_legacy_op14 (RMSNorm decoder). The recipes (``RECIPES``):

* ``dynamic``            quantize_dynamic, QInt8 weights, per tensor (activations: DynamicQuantizeLinear)
* ``dynamic_channel``    quantize_dynamic, QInt8, per_channel=True
* ``qdq``                quantize_static, QDQ, every op type ORT quantizes (Q/DQ pairs inside every norm)
* ``qdq_matmul``         quantize_static, QDQ, op_types_to_quantize=["MatMul"] (norms float, their outputs
                         quantized for the next MatMul)
* ``qoperator``          quantize_static, QOperator format (QLinearMatMul, QLinearAdd, ...)
* ``nbits``              MatMulNBitsQuantizer, 4 bits, block 32, accuracy_level unset (float compute)
* ``nbits_acc4``         the same with accuracy_level=4 (the kernel quantizes its float input to int8)
* ``fp16``               onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)
* ``fp16_blocked``       the same with op_block_list=["ReduceMean", "Pow", "Sqrt", "Reciprocal"] (statistics in
                         fp32, Casts around them)

Calibration (static recipes): 8 batches of 2 x 8 from a fixed seed, ids below each lookup table's rows, masks of
ones. Every written model passes onnx's full check and loads in ONNX Runtime.
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                      quantize_static)
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
from onnxruntime.transformers.float16 import convert_float_to_float16

from checked import save_checked

HERE = Path(__file__).resolve().parent
ZOO = HERE / "quantized"
SOURCES = ("bert_tiny_legacy_op14", "gpt2_tiny_legacy_op14", "llama_tiny_legacy_op14")
BATCH, SEQUENCE, CALIBRATION_BATCHES = 2, 8, 8
#: the ops convert_float_to_float16's op_block_list keeps in fp32 in the ``fp16_blocked`` recipe: a norm's statistics
STATISTICS_OPS = ("ReduceMean", "Pow", "Sqrt", "Reciprocal")


def id_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For each integer graph input used as lookup ids: the rows of the smallest table it indexes directly."""
    rows = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in rows:
            bounds[node.input[1]] = min(bounds.get(node.input[1], rows[node.input[0]]), rows[node.input[0]])
    return bounds


def feeds(model: onnx.ModelProto, rng: np.random.Generator, batch: int = BATCH,
          sequence: int = SEQUENCE) -> dict[str, np.ndarray]:
    """One input set for a text model: ids below their table's rows, other integers (masks) ones, floats N(0, 1);
    symbolic dims are ``batch`` (the first) and ``sequence``."""
    bounds = id_bounds(model)
    out = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else sequence)
                 for i, d in enumerate(t.shape.dim)]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            out[value.name] = (rng.integers(0, bounds[value.name], shape) if value.name in bounds
                               else np.ones(shape)).astype(dtype)
        else:
            out[value.name] = rng.standard_normal(shape).astype(dtype)
    return out


class Calibration(CalibrationDataReader):
    """``CALIBRATION_BATCHES`` input sets of ``feeds`` from seed 0."""

    def __init__(self, model: onnx.ModelProto):
        rng = np.random.default_rng(0)
        self.batches: Iterator[dict[str, np.ndarray]] = iter(
            [feeds(model, rng) for _ in range(CALIBRATION_BATCHES)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)


def _dynamic(per_channel: bool) -> Callable[[Path, Path], None]:
    def recipe(source: Path, out: Path) -> None:
        quantize_dynamic(source, out, weight_type=QuantType.QInt8, per_channel=per_channel)
    return recipe


def _static(quant_format: QuantFormat, op_types: list[str] | None = None) -> Callable[[Path, Path], None]:
    def recipe(source: Path, out: Path) -> None:
        quantize_static(source, out, Calibration(onnx.load(source)), quant_format=quant_format,
                        op_types_to_quantize=op_types, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8)
    return recipe


def _nbits(accuracy_level: int | None) -> Callable[[Path, Path], None]:
    def recipe(source: Path, out: Path) -> None:
        quantizer = MatMulNBitsQuantizer(onnx.load(source), bits=4, block_size=32, is_symmetric=True,
                                         accuracy_level=accuracy_level)
        quantizer.process()
        onnx.save(quantizer.model.model, out)
    return recipe


def _fp16(op_block_list: tuple[str, ...] | None) -> Callable[[Path, Path], None]:
    def recipe(source: Path, out: Path) -> None:
        blocked = list(op_block_list) if op_block_list is not None else None
        onnx.save(convert_float_to_float16(onnx.load(source), keep_io_types=True, op_block_list=blocked), out)
    return recipe


#: recipe name -> what it does to a float model file (source, output)
RECIPES: MappingProxyType[str, Callable[[Path, Path], None]] = MappingProxyType({
    "dynamic": _dynamic(per_channel=False),
    "dynamic_channel": _dynamic(per_channel=True),
    "qdq": _static(QuantFormat.QDQ),
    "qdq_matmul": _static(QuantFormat.QDQ, ["MatMul"]),
    "qoperator": _static(QuantFormat.QOperator),
    "nbits": _nbits(accuracy_level=None),
    "nbits_acc4": _nbits(accuracy_level=4),
    "fp16": _fp16(op_block_list=None),
    "fp16_blocked": _fp16(op_block_list=STATISTICS_OPS),
})
#: recipes whose tool writes the Casts it adds after the nodes reading them (onnxruntime 1.32): kept that way
UNSORTED = frozenset({"fp16_blocked"})


def zoo_name(source: str, recipe: str) -> str:
    return f"{source}__{recipe}.onnx"


def op_histogram(model: onnx.ModelProto) -> Counter:
    """(domain::)op type -> count, over the main graph (the zoo's models have no subgraphs or functions)."""
    return Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                   for n in model.graph.node)


def make(source: str, recipe: str, folder: Path) -> Path:
    """Apply ``recipe`` to ``sample_models/<source>.onnx``; write, check and return ``folder/<source>__<recipe>.onnx``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / zoo_name(source, recipe)
    with tempfile.TemporaryDirectory() as tmp:
        # the quantizers write helper files (augmented models, external data) next to what they are given
        staged = Path(tmp) / out.name
        RECIPES[recipe](HERE / f"{source}.onnx", staged)
        model = onnx.load(staged)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    save_checked(model, out, any_node_order=recipe in UNSORTED)
    return out


def main() -> None:
    logging.disable(logging.WARNING)  # the quantizers log every node they look at, and every type they cannot infer
    for source in SOURCES:
        for recipe in RECIPES:
            make(source, recipe, ZOO)


if __name__ == "__main__":
    main()
