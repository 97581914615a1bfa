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


def test_weights_stay_in_the_input_file_until_saved(tmp_path: Path):
    """Weights no rule needs are copied from the input file when saving; if that file changed in between, saving
    stops with a clear error instead of writing other weights."""
    model = tmp_path / "model.onnx"
    model.write_bytes((SAMPLES / "bert_tiny_legacy_op14.onnx").read_bytes())
    result = lnfuse.fuse(model)
    held = {t.name: t.SerializeToString() for t in result.model.graph.initializer}
    first = tmp_path / "first.onnx"
    result.save(first)
    assert {t.name: t.SerializeToString() for t in onnx.load(str(first)).graph.initializer} == held
    model.write_bytes(b"\0" * model.stat().st_size)  # same size, other bytes: the input was rewritten
    with pytest.raises(lnfuse.InputError, match="changed after lnfuse read it"):
        result.save(tmp_path / "second.onnx")
    assert not (tmp_path / "second.onnx").exists()


def test_in_place_rewrite_reads_the_weights_before_replacing_the_file(tmp_path: Path):
    model = tmp_path / "model.onnx"
    model.write_bytes((SAMPLES / "gpt2_tiny_legacy_op14.onnx").read_bytes())
    result = lnfuse.fuse(model)
    held = {t.name: t.SerializeToString() for t in result.model.graph.initializer}
    result.save(model, in_place=True)
    assert {t.name: t.SerializeToString() for t in onnx.load(str(model)).graph.initializer} == held
    ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
