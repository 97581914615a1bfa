"""What lnfuse writes is exactly the model it holds, however the bytes are laid out on disk."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

import lnfuse

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


@pytest.mark.parametrize("name,target", [("llama_tiny_dynamo_op18.onnx", "ort"),
                                         ("roberta_tiny_dynamo_op18.onnx", "onnx")])
def test_saved_file_is_the_fused_model(tmp_path: Path, name: str, target: str):
    result = lnfuse.fuse(SAMPLES / name, target=target)
    out = tmp_path / "fused.onnx"
    result.save(out)
    written, held = onnx.load(str(out)), result.model
    large = [t for t in held.graph.initializer if len(t.raw_data) >= 1 << 12]
    assert large, "the sample has weights large enough to be written one by one"
    assert {t.name: t.SerializeToString() for t in written.graph.initializer} == \
        {t.name: t.SerializeToString() for t in held.graph.initializer}
    assert [n.SerializeToString() for n in written.graph.node] == [n.SerializeToString() for n in held.graph.node]
    assert written.graph.input == held.graph.input and written.graph.output == held.graph.output
    assert written.opset_import == held.opset_import and written.ir_version == held.ir_version
    if result.report.ort_only:
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    else:
        onnx.checker.check_model(str(out), full_check=True)
