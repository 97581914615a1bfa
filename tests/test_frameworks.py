"""The framework zoo (sample_models/frameworks, issue 20): what JAX/Flax/Equinox (jax2onnx; jax2tf + tf2onnx), Keras 3
and tf-keras (tf2onnx), PaddlePaddle (paddle2onnx), MindSpore and spox/onnxscript really write for LayerNorm, RMSNorm,
residual + LayerNorm, embedding + LayerNorm and channels-first norms. No framework is imported here: each model has a
sibling .npz with one input and the framework's own output for it (``sample_models/frameworks/_common.py``).

For every model:
  (a) ONNX Runtime on the file reproduces the framework's output (the data is sound);
  (b) ``lnfuse.fuse`` never changes what the model computes, for both targets, and ``--target onnx`` output passes
      the full checker: this must always hold;
  (c) what a serious fuser should write (``EXPECTED``): where lnfuse does not yet, the case is a strict xfail naming
      the spelling, so the gap stays visible and a fix turns it into an XPASS, which fails: remove the mark then;
  (d) ``explain`` names a candidate for every norm written out, and never gives the RMS formula as the reason for a
      centred norm; strict xfail where it does not yet.
Run ``python sample_models/frameworks/table.py`` for the same facts as a table (docs/exporters.md).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import lnfuse

FRAMEWORKS = Path(__file__).resolve().parent.parent / "sample_models" / "frameworks"
MODELS = sorted(p.relative_to(FRAMEWORKS).with_suffix("").as_posix() for p in FRAMEWORKS.glob("*/*.onnx"))
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization")
# what a norm's statistics are computed with; none is left once every norm is fused (BatchNormalization: tf-keras's
# fused LayerNorm path normalizes with one)
STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "GlobalAveragePool", "BatchNormalization")
# framework output vs ONNX Runtime: float32 with different reduction orders (worst seen 9.5e-7)
RTOL = ATOL = 1e-4


class Case(NamedTuple):
    fused: dict[str, int]          # norm ops in the fused model (target ort)
    fuse_gap: str | None = None    # why lnfuse does not write that yet (strict xfail of (c))
    explain_gap: str | None = None  # why explain does not name the norm rightly yet (strict xfail of (d))
    norms: int = 1                 # norms written out that explain must name (0: only native ops, nothing to name)
    centred: bool = True           # a LayerNorm (the RMS formula is never its reason)
    statistics_left: int = 0       # statistics ops that are not a fusable norm


LN = {"LayerNormalization": 1}
SLN = {"SimplifiedLayerNormalization": 1}   # ORT's RMS norm below opset 23
RMS = {"RMSNormalization": 1}               # ONNX's, from opset 23
SKIP = {"SkipLayerNormalization": 1}
EMBED = {"EmbedLayerNormalization": 1}

PADDLE_IDENTITY = "the sum reaches the norm through Identity → Identity"

EXPECTED: dict[str, Case] = {
    # ---- jax2onnx 0.17.1 (opset 23: RMS norms become ONNX RMSNormalization)
    "jax2onnx/flax_layernorm": Case(LN),
    "jax2onnx/linen_layernorm": Case(LN),
    "jax2onnx/flax_rmsnorm": Case(RMS, centred=False),
    "jax2onnx/flax_residual_layernorm": Case(SKIP),
    "jax2onnx/flax_embedding_layernorm": Case(EMBED),
    "jax2onnx/eqx_layernorm": Case(LN),
    "jax2onnx/eqx_rmsnorm": Case(RMS, centred=False),
    "jax2onnx/eqx_residual_layernorm": Case(SKIP),
    # vmap's Reshape [S, H] -> [1, S, H] and Expand to its own shape on the position lookup; Cast(ids, int64)
    "jax2onnx/eqx_embedding_layernorm": Case(EMBED),
    "jax2onnx/jnp_layernorm": Case(LN),
    "jax2onnx/jnp_channels_first": Case(LN),
    # ---- jax2tf (jax 0.4.30, non-native) + tf2onnx 1.17 (opset 17)
    "jax2tf/flax_layernorm": Case(LN),
    "jax2tf/flax_rmsnorm": Case(SLN, centred=False),
    "jax2tf/flax_residual_layernorm": Case(SKIP),
    "jax2tf/flax_indexed_embedding_layernorm": Case(EMBED),
    "jax2tf/flax_channels_first": Case(LN),
    # vmap's Transpose(perm 1, 2, 0) between the weight and the statistics: an RMS norm of Transpose(h)
    "jax2tf/eqx_rmsnorm": Case(SLN, centred=False),
    # ---- tf2onnx 1.17 from Keras 3.15 (opset 17)
    "keras3/layernorm": Case(LN),
    "keras3/rmsnorm": Case(SLN, centred=False),
    # deprecated rms_scaling=True is x * rsqrt(var + eps) * gamma: no norm op computes it, nothing may be fused
    "keras3/rms_scaling": Case({}, statistics_left=2),
    "keras3/residual_layernorm": Case(SKIP),
    "keras3/embedding_layernorm": Case(EMBED),
    "keras3/channels_first": Case(LN),
    # ---- keras-hub 0.32 backbones and Keras 3 layers, Keras' own model.export (tf2onnx 1.17, opset 15; issue 28)
    # keras-hub's PositionEmbedding slices its table: positions 0..S-1 with no ids. BERT's segment ids are an input of
    # their own, whose dims tf2onnx names apart from the token ids': the ids and positions go to the kernel expanded
    # to the broadcast the Add does
    "keras_hub/tf_bert": Case({"EmbedLayerNormalization": 1, "SkipLayerNormalization": 2}, norms=3),
    "keras_hub/tf_gpt2": Case({"EmbedLayerNormalization": 1, "SkipLayerNormalization": 2}, norms=3),
    # parallel residual: two norms of one input share its statistics (5 norms, 3 statistics)
    "keras_hub/tf_gpt_neox": Case({"LayerNormalization": 3, "SkipLayerNormalization": 2}, norms=5),
    "keras_hub/tf_token_and_position": Case(EMBED),
    # table[1:S+1], table[0:2S:2]: not positions 0..S-1; the sum's broadcast dims keep the Skip op out too
    "keras_hub/tf_position_offset": Case(LN),
    "keras_hub/tf_position_step2": Case(LN),
    # table[0:8] folded to a constant broadcast to a dynamic S; a [H, max] table cut along axis 1
    "keras_hub/tf_position_fixed_end": Case(SKIP),
    "keras_hub/tf_position_axis1": Case(SKIP),
    # keras-hub through jax2onnx 0.17.1 (opset 23, batch and sequence static): jax2onnx keeps the Slice, ends 8
    "keras_hub/jax_bert": Case({"EmbedLayerNormalization": 1, "SkipLayerNormalization": 2}, norms=3),
    "keras_hub/jax_token_and_position": Case(EMBED),
    # keras-hub through torch 2.13's dynamo exporter (opset 20, static): native LayerNormalization, the sliced
    # table folded to a constant
    "keras_hub/torch_bert": Case({"EmbedLayerNormalization": 1, "SkipLayerNormalization": 2}, norms=0),
    "keras_hub/torch_gpt2": Case({"EmbedLayerNormalization": 1, "SkipLayerNormalization": 2}, norms=0),
    "keras_hub/torch_gpt_neox": Case({"LayerNormalization": 3, "SkipLayerNormalization": 2}, norms=0),
    "keras_hub/torch_token_and_position": Case(EMBED, norms=0),
    # ---- tf2onnx 1.17 from tf-keras 2.21 (opset 17)
    "tf_keras/layernorm": Case(LN),
    "tf_keras/layernorm_eps1e-6": Case(LN),
    "tf_keras/rmsnorm": Case(SLN, centred=False),
    "tf_keras/residual_layernorm": Case(SKIP),
    "tf_keras/embedding_layernorm": Case(EMBED),
    "tf_keras/channels_first": Case(LN),
    # ---- paddle2onnx 2.1 from PaddlePaddle 3.3 (opsets 11 and 17)
    "paddle/layernorm_op11": Case(LN),
    "paddle/layernorm_op17": Case(LN, norms=0),  # written as LayerNormalization: nothing to fuse or name
    "paddle/rmsnorm_op11": Case(SLN, centred=False),
    "paddle/rmsnorm_op17": Case(SLN, centred=False),
    "paddle/residual_layernorm_op11": Case(SKIP),  # the sum reaches the norm through Identity -> Identity
    "paddle/residual_layernorm_op17": Case(SKIP),  # the same, into a native LayerNormalization
    "paddle/embedding_layernorm_op11": Case(EMBED),  # position lookup folded to a [1, S, H] constant
    "paddle/embedding_layernorm_op17": Case(EMBED),
    "paddle/channels_first_op11": Case(LN),  # Sub(x, mean) twice behind Identities, variance × 1
    "paddle/channels_first_op17": Case(LN),
    # ---- MindSpore 2.10 (opset 11, static shapes)
    "mindspore/layernorm": Case(LN),
    "mindspore/rmsnorm": Case(SLN, centred=False),
    "mindspore/residual_layernorm": Case(SKIP),
    # Reshape(Gather(word, Reshape(ids, [-1])), [2, 8, 32]) is Gather(word, ids)
    "mindspore/embedding_layernorm": Case(EMBED),
    "mindspore/channels_first": Case(LN),
    # ---- spox 0.18 and onnxscript 0.7 (the framework is ONNX; opset 18)
    "spox/layernorm": Case(LN),
    "spox/rmsnorm": Case(SLN, centred=False),
    "spox/residual_layernorm": Case(SKIP),
    "spox/embedding_layernorm": Case(EMBED),
    "spox/channels_first": Case(LN),
    "onnxscript/layernorm": Case(LN),
    "onnxscript/layernorm_optimized": Case(LN),
    "onnxscript/rmsnorm": Case(SLN, centred=False),
    "onnxscript/rmsnorm_optimized": Case(SLN, centred=False),
    "onnxscript/residual_layernorm": Case(SKIP),
    "onnxscript/embedding_layernorm": Case(EMBED),
    "onnxscript/channels_first": Case(LN),
}


def _params(gap_of):
    """Each model, a strict xfail where ``gap_of(case)`` names a gap."""
    out = []
    for name in MODELS:
        case = EXPECTED.get(name)
        gap = gap_of(case) if case else None
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 20: {gap} not matched yet")] if gap else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _data(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    with np.load(FRAMEWORKS / f"{name}.npz") as npz:
        names = [str(n) for n in npz["input_names"]]
        return {n: npz[f"input_{i}"] for i, n in enumerate(names)}, npz["expected"]


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # what the file says, nothing more
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@functools.cache
def _fused(name: str, target: str) -> lnfuse.FuseResult:
    return lnfuse.fuse(FRAMEWORKS / f"{name}.onnx", target=target)


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_every_model_has_an_expectation():
    assert len(MODELS) >= 50, "the zoo is there"
    assert set(MODELS) == set(EXPECTED), (sorted(set(MODELS) - set(EXPECTED)), sorted(set(EXPECTED) - set(MODELS)))


def test_models_are_small_and_the_data_is_whole():
    for name in MODELS:
        assert (FRAMEWORKS / f"{name}.onnx").stat().st_size < 1 << 20, name
        feeds, expected = _data(name)
        assert feeds and np.isfinite(expected).all(), name
    for folder in {name.split("/")[0] for name in MODELS}:
        assert (FRAMEWORKS / folder / "versions.json").is_file(), folder


@pytest.mark.parametrize("name", MODELS)
def test_ort_reproduces_the_framework(name):
    """(a) the data is sound: ONNX Runtime on the exported file computes the framework's own output."""
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(FRAMEWORKS / f"{name}.onnx", feeds), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("name", MODELS)
def test_fusing_never_changes_the_numbers(name, target):
    """(b) whatever lnfuse fuses or leaves, the fused model computes the framework's output."""
    result = _fused(name, target)
    feeds, expected = _data(name)
    np.testing.assert_allclose(_run(result.model, feeds), expected, rtol=RTOL, atol=ATOL)
    if target == "onnx":
        onnx.checker.check_model(result.model, full_check=True)
    for unfused in result.report.unfused:
        assert unfused.reason, "every candidate left alone says why"


@pytest.mark.parametrize("name", _params(lambda case: case.fuse_gap))
def test_fuses_what_a_fuser_should(name):
    """(c) the norm ops a serious fuser writes (target ort), and no statistics left behind."""
    case = EXPECTED[name]
    ops = _ops(_fused(name, "ort").model)
    got = {op: ops[op] for op in NORM_OPS if ops.get(op)}
    assert got == case.fused, (got, [(u.rule, u.check, u.reason) for u in _fused(name, "ort").report.unfused])
    left = sum(ops.get(op, 0) for op in STATISTICS)
    assert left == case.statistics_left, f"{left} statistics ops left ({ {op: ops.get(op) for op in STATISTICS} })"


@pytest.mark.parametrize("name", _params(lambda case: case.explain_gap))
def test_explain_names_every_norm(name):
    """(d) explain lists a candidate (fused, or left with a reason) for every norm written out, and a centred norm
    is never explained by the RMS formula."""
    case = EXPECTED[name]
    report = _fused(name, "ort").report
    text = report.explain()
    candidates = len(report.fused) + len(report.unfused)
    assert candidates >= case.norms, text
    if case.norms:
        assert "no normalization-like candidates" not in text, text
    if case.centred:
        assert not [u for u in report.unfused if u.rule == "rms_norm"], text
