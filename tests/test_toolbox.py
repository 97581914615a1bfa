"""lnfuse among the tools around it: --version, FusePass in an onnx_ir PassManager next to onnxscript's passes, torch's
ONNXProgram as input, provenance in the written model, and ``explain --annotate``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import lnfuse
from lnfuse.cli import main
from lnfuse.errors import UsageError

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
BERT = SAMPLES / "bert_tiny_legacy_op14.onnx"
BERT_OP18 = SAMPLES / "bert_tiny_dynamo_op18.onnx"


def test_version_needs_no_model_and_names_the_libraries():
    done = subprocess.run([sys.executable, "-m", "lnfuse.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"lnfuse {metadata.version('lnfuse')} (")
    for name, version in (("onnx", onnx.__version__), ("onnxruntime", ort.__version__)):
        assert f"{name} {version}" in line
    assert f"onnxscript {metadata.version('onnxscript')}" in line
    assert done.stderr == ""
    assert lnfuse.__version__ == metadata.version("lnfuse")


# --- torch's dynamo exporter: an ONNXProgram, and FusePass in a PassManager ----------------------------------------
# The PassManager tests run on two tiny dynamo exports shipped in sample_models/toolbox/ (make_toolbox_samples.py),
# each with its input and torch's output beside it, so the suite needs no torch. Only the ONNXProgram test exports
# (torch is not in the test extra: it skips where torch is not installed).

TOOLBOX = SAMPLES / "toolbox"
POSTNORM = TOOLBOX / "postnorm_dynamo_op18.onnx"  # BERT-style residual block, LayerNorm as math, a scale of 1
RESIDUAL = TOOLBOX / "residual_dynamo_op20.onnx"  # nn.LayerNorm(dense(x) + x): a LayerNormalization node


def _io(model_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The input the sample was exported with and torch's own output for it."""
    with np.load(model_path.with_suffix(".npz")) as saved:
        return saved["x"], saved["expected"]


def _ops(model: ir.Model | onnx.ModelProto) -> list[str]:
    nodes = model.graph.node if isinstance(model, onnx.ModelProto) else model.graph
    return [n.op_type for n in nodes]


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_fuse_takes_an_onnx_program_and_leaves_it_alone():
    torch = pytest.importorskip("torch", reason="torch's ONNXProgram needs torch (CPU build: docs/development.md)")
    spec = importlib.util.spec_from_file_location("make_toolbox_samples", SAMPLES / "make_toolbox_samples.py")
    samples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(samples)
    torch.manual_seed(0)
    module = samples.PostNorm().eval()
    x = torch.randn(2, 5, 16)
    program = torch.onnx.export(module, (x,), dynamo=True, opset_version=18, optimize=False, verbose=False)
    with torch.no_grad():
        expected = module(x).numpy()
    assert type(program).__name__ == "ONNXProgram" and isinstance(program.model, ir.Model)
    before = _ops(program.model)
    result = lnfuse.fuse(program)
    assert _ops(program.model) == before
    assert "ReduceMean" not in _ops(result.model)
    assert result.report.fused_counts() == {"SkipLayerNormalization": 1}
    np.testing.assert_allclose(_run(result.model, x.numpy()), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target, fused_op", [("ort", "SkipLayerNormalization"), ("onnx", "LayerNormalization")])
def test_fuse_pass_runs_in_a_pass_manager_after_onnxscript_passes(target, fused_op):
    from onnxscript.rewriter import RewritePass
    from onnxscript.rewriter.rules.common import mul_by_1_rule

    x, expected = _io(POSTNORM)
    model = ir.load(POSTNORM)
    assert "Mul" in _ops(model)  # the scale of 1, left for onnxscript's rule
    fuse_pass = lnfuse.FusePass(target=target)
    manager = ir.passes.PassManager([RewritePass([mul_by_1_rule]), ir.passes.common.IdentityEliminationPass(),
                                     fuse_pass, ir.passes.common.CheckerPass(full_check=True)])
    result = manager(model)
    ops = _ops(result.model)
    assert result.modified and fused_op in ops
    assert "ReduceMean" not in ops and ops.count("Mul") == 0 and "Identity" not in ops
    assert fuse_pass.report.fused_counts() == {fused_op: 1} and not fuse_pass.report.unfused
    assert result.model.metadata_props["lnfuse.target"] == target
    np.testing.assert_allclose(_run(ir.serde.serialize_model(result.model), x), expected, rtol=1e-4, atol=1e-5)


def test_fuse_pass_folds_the_residual_into_torch_layer_norm():
    """nn.LayerNorm exports as LayerNormalization; with target ort the residual Add before it becomes a Skip op."""
    x, expected = _io(RESIDUAL)
    model = ir.load(RESIDUAL)
    assert "LayerNormalization" in _ops(model)
    fuse_pass = lnfuse.FusePass()
    result = ir.passes.PassManager([fuse_pass, ir.passes.common.RemoveUnusedNodesPass()])(model)
    assert result.modified and fuse_pass.report.fused_counts() == {"SkipLayerNormalization": 1}
    assert "LayerNormalization" not in _ops(result.model)
    np.testing.assert_allclose(_run(ir.serde.serialize_model(result.model), x), expected, rtol=1e-4, atol=1e-5)


def test_fuse_pass_is_functional_and_checks_its_options_when_built():
    model = ir.load(POSTNORM)
    before = _ops(model)
    result = lnfuse.FusePass(only=["layer_norm"])(model)
    assert result.model is not model and _ops(model) == before
    assert "LayerNormalization" in _ops(result.model)
    again = lnfuse.FusePass(only=["layer_norm"])(result.model)
    assert not again.modified
    with pytest.raises(UsageError, match="unknown rule"):
        lnfuse.FusePass(only=["no_such_rule"])
    with pytest.raises(UsageError, match="unknown target"):
        lnfuse.FusePass(target="tensorrt")


# --- provenance ---------------------------------------------------------------------------------------------------

def _props(entries) -> dict[str, str]:
    return {p.key: p.value for p in entries}


def test_written_model_says_what_lnfuse_did(tmp_path):
    source = onnx.load(BERT_OP18)
    source.metadata_props.add(key="author", value="the exporter")
    result = lnfuse.fuse(source, target="onnx")
    result.save(tmp_path / "fused.onnx")
    written = onnx.load(tmp_path / "fused.onnx")
    onnx.checker.check_model(written, full_check=True)
    props = _props(written.metadata_props)
    assert props["author"] == "the exporter"
    assert props["lnfuse.version"] == metadata.version("lnfuse")
    assert props["lnfuse.target"] == "onnx"
    assert json.loads(props["lnfuse.options"])["verify"] is True
    assert json.loads(props["lnfuse.fused"]) == {"LayerNormalization": 5}
    assert props["lnfuse.unfused"] == "0"
    input_names = {n.name for n in source.graph.node}
    fused = [n for n in written.graph.node if n.op_type == "LayerNormalization"]
    assert len(fused) == 5
    for node in fused:
        meta = _props(node.metadata_props)
        replaced = json.loads(meta["lnfuse.replaced"])
        assert meta["lnfuse.rule"] == "layer_norm"
        assert replaced and set(replaced) <= input_names
        assert not set(replaced) & {n.name for n in written.graph.node}
        assert 0 <= float(meta["lnfuse.max_error"]) < 1e-3
        assert node.doc_string.startswith("lnfuse layer_norm: replaces") and "verified in ONNX Runtime" in node.doc_string


def test_a_skip_op_names_the_input_nodes_of_the_norm_it_absorbed(tmp_path):
    out = tmp_path / "fused.onnx"
    assert main([str(BERT), "-o", str(out), "-q", "--no-verify"]) == 0
    written = onnx.load(out)
    input_names = {n.name for n in onnx.load(BERT).graph.node}
    skips = [n for n in written.graph.node if n.op_type == "SkipLayerNormalization"]
    assert len(skips) == 4
    for node in skips:
        meta = _props(node.metadata_props)
        replaced = json.loads(meta["lnfuse.replaced"])
        assert meta["lnfuse.rule"] == "skip_norm" and meta["lnfuse.max_error"] == "not verified"
        assert set(replaced) <= input_names and {"ReduceMean", "Add"} <= {r.split("/")[-1].split("_")[0]
                                                                          for r in replaced}
    assert json.loads(_props(written.metadata_props)["lnfuse.options"])["verify"] is False


def test_a_malformed_provenance_record_in_the_input_is_ignored():
    source = onnx.load(BERT_OP18)
    reduce_mean = next(n for n in source.graph.node if n.op_type == "ReduceMean")
    reduce_mean.metadata_props.add(key="lnfuse.replaced", value="{not json")
    result = lnfuse.fuse(source, target="onnx", verify=False)
    records = [json.loads(n.metadata_props["lnfuse.replaced"]) for n in result.ir_model.graph
               if n.op_type == "LayerNormalization"]
    assert len(records) == 5 and any(reduce_mean.name in names for names in records)


def test_quantized_embedding_names_the_input_nodes_it_stands_for(tmp_path):
    out = tmp_path / "q.onnx"
    assert main([str(BERT), "-o", str(out), "-q", "--quantize-embeddings", "uint8"]) == 0
    node = next(n for n in onnx.load(out).graph.node if n.op_type == "QEmbedLayerNormalization")
    meta = _props(node.metadata_props)
    assert meta["lnfuse.rule"] == "quantize_embeddings"
    assert {"/word/Gather", "/embedding_norm/ReduceMean"} <= set(json.loads(meta["lnfuse.replaced"]))


def test_decompose_replaces_what_an_earlier_fuse_recorded(tmp_path):
    fused, plain = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    assert main([str(BERT_OP18), "-o", str(fused), "-q", "--target", "onnx"]) == 0
    assert main(["decompose", str(fused), "-o", str(plain), "-q"]) == 0
    written = onnx.load(plain)
    onnx.checker.check_model(written, full_check=True)
    props = _props(written.metadata_props)
    assert json.loads(props["lnfuse.decomposed"]) == {"LayerNormalization": 5} and props["lnfuse.left"] == "0"
    assert "lnfuse.fused" not in props and json.loads(props["lnfuse.options"])["command"] == "decompose"


def test_annotated_copy_carries_the_reasons_and_the_same_weights(tmp_path, capsys):
    out = tmp_path / "explained.onnx"
    assert main(["explain", str(BERT), "--target", "onnx", "--annotate", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    original, annotated = onnx.load(BERT), onnx.load(out)
    onnx.checker.check_model(annotated, full_check=True)
    assert _ops(annotated) == _ops(original)
    assert {t.name: t.SerializeToString() for t in annotated.graph.initializer} == \
        {t.name: t.SerializeToString() for t in original.graph.initializer}
    refused = {n.name: _props(n.metadata_props)["lnfuse.refused"] for n in annotated.graph.node
               if "lnfuse.refused" in _props(n.metadata_props)}
    assert sum(name.endswith("ReduceMean") or name.endswith("ReduceMean_1") for name in refused) == 10
    assert all("layer_norm/opset" in why and "opset 17" in why for why in refused.values())
    node = next(n for n in annotated.graph.node if n.name in refused)
    assert node.doc_string.startswith("lnfuse: left unfused: layer_norm/opset")
    assert "5 candidate(s) left unfused" in _props(annotated.metadata_props)["lnfuse.explained"]


def test_annotated_copy_marks_what_fuses(tmp_path):
    out = tmp_path / "explained.onnx"
    assert main(["explain", str(BERT), "--annotate", str(out), "--json"]) == 0
    annotated = onnx.load(out)
    marks = [_props(n.metadata_props).get("lnfuse.fuses_into") for n in annotated.graph.node]
    assert any(m and "SkipLayerNormalization (skip_norm)" in m for m in marks)
    assert any(m and "EmbedLayerNormalization (embed_norm)" in m for m in marks)
    assert _ops(annotated) == _ops(onnx.load(BERT))


def test_annotate_refuses_to_overwrite_the_input(tmp_path, capsys):
    copy = tmp_path / "model.onnx"
    copy.write_bytes(BERT.read_bytes())
    assert main(["explain", str(copy), "--annotate", str(copy)]) == 2
    assert "overwrite the input" in capsys.readouterr().err
    assert copy.read_bytes() == BERT.read_bytes()


# --- optional third-party tools: run only where they are installed (docs/toolbox.md says which were) -------------

def test_lnfuse_as_an_olive_pass(tmp_path):
    pytest.importorskip("olive.workflows")
    from olive.workflows import run as olive_run

    from lnfuse.integrations.olive import package_config

    workflow = {
        "input_model": {"type": "ONNXModel", "model_path": str(BERT)},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": [
            {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
        "passes": {"fuse": {"type": "LnfuseFusion", "target": "onnx", "upgrade_opset": True}},
        "host": "local_system", "target": "local_system",
        "cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"),
    }
    olive_run(workflow, package_config=package_config())
    written = onnx.load(tmp_path / "out" / "model.onnx")
    onnx.checker.check_model(written, full_check=True)
    assert _ops(written).count("LayerNormalization") == 5 and "ReduceMean" not in _ops(written)
    assert json.loads(_props(written.metadata_props)["lnfuse.options"])["upgrade_opset"] is True


def test_lnfuse_after_an_optimum_export(tmp_path):
    exporters = pytest.importorskip("optimum.exporters.onnx")
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(tmp_path / "bert")
    exporters.main_export(str(tmp_path / "bert"), output=tmp_path / "onnx", task="feature-extraction")
    fused = tmp_path / "onnx" / "model.fused.onnx"
    assert main([str(tmp_path / "onnx" / "model.onnx"), "-o", str(fused), "--verify", "model", "-q"]) == 0
    ops = _ops(onnx.load(fused))
    assert ops.count("SkipLayerNormalization") == 4 and ops.count("EmbedLayerNormalization") == 1
    assert "ReduceMean" not in ops
