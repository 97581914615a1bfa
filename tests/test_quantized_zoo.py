"""The quantized zoo (issue 28): three float samples through every recipe of ONNX Runtime's quantizers and fp16
converter (``sample_models/make_quantized_zoo.py``, files in ``sample_models/quantized/``), fused with lnfuse's API
under the default policy. Each model must come out:

(a) well-formed: onnx's full check (unless it holds an op of ONNX's domain only ORT defines), and an ONNX Runtime
    load where it holds ops only ORT runs;
(b) with no value entering any quantizer moved: every float tensor a QuantizeLinear, DynamicQuantizeLinear,
    DynamicQuantizeMatMul, MatMulNBits (accuracy_level 4) or QOperator op reads is bitwise the same, by name, on
    16 input sets of several sizes, run with ORT's graph optimizations off (ORT fuses nothing for us) and on;
(c) computing the same outputs within the tolerance of the dtype the model computes in;
(d) fused as the table ``EXPECTED`` says for its recipe, with and without ``allow_requantization``; a norm left
    because of a quantizer names it;
(e) reporting every norm of the float model as a candidate, fused or left.

The committed files are what ONNX Runtime's tools wrote (onnxruntime 1.32.0); ``test_the_recipes_still_write_these
_ops`` runs the script again on the installed ONNX Runtime, so a new quantizer spelling fails here first.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import pytest

import lnfuse
from lnfuse.index.ops import only_ort_runs
from normgraphs import tolerance
from quantizers import Runs, run_both, session

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
sys.path.insert(0, str(SAMPLES))
from make_quantized_zoo import RECIPES, SOURCES, ZOO, make, op_histogram, zoo_name  # noqa: E402

BERT, GPT2, LLAMA = SOURCES
#: what lnfuse fuses in each float source: every norm
FULL = MappingProxyType({
    BERT: {"EmbedLayerNormalization": 1, "SkipLayerNormalization": 4},
    GPT2: {"EmbedLayerNormalization": 1, "SkipLayerNormalization": 4},
    LLAMA: {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4},
})
#: the norms whose output reaches no quantizer when every MatMul with weights quantizes its input: BERT's and
#: GPT-2's last norm (with its residual Add), which feeds the graph output; LLaMA's last norm feeds lm_head
TAIL = MappingProxyType({BERT: {"SkipLayerNormalization": 1}, GPT2: {"SkipLayerNormalization": 1}, LLAMA: {}})
NONE = MappingProxyType({source: {} for source in SOURCES})
#: quantize_dynamic's 8-bit tables with float gamma and beta: the embedding norm stays a SkipLayerNormalization
#: (no EmbedLayerNormalization over a whole dequantized table, no quantized gamma unless asked)
QUANTIZED_TABLES = MappingProxyType({BERT: {"SkipLayerNormalization": 5}, GPT2: {"SkipLayerNormalization": 5},
                                     LLAMA: FULL[LLAMA]})


@dataclass(frozen=True)
class Expected:
    """What lnfuse should make of a recipe's models: fused op counts per source under the default policy and with
    ``allow_requantization``; ``refused_by``: the quantizer op types a norm left unfused names (empty: the norm is
    left for another reason, or none is left); ``quantizes``: the models hold quantizers of float activations;
    ``dtype``: what the model computes in."""

    default: MappingProxyType
    allowed: MappingProxyType
    refused_by: tuple[str, ...] = ()
    quantizes: bool = True
    dtype: str = "float32"


# A rewrite whose changed values can reach a quantizer is refused, whatever a sample shows (docs/quantized.md).
EXPECTED = MappingProxyType({
    # DynamicQuantizeLinear is a quantizer: only the norms after the last quantized MatMul fuse by default
    "dynamic": Expected(TAIL, QUANTIZED_TABLES, ("DynamicQuantizeLinear",)),
    "dynamic_channel": Expected(TAIL, QUANTIZED_TABLES, ("DynamicQuantizeLinear",)),
    # Q/DQ pairs round inside every norm: no fused op computes that, allowed or not
    "qdq": Expected(NONE, NONE, ("QuantizeLinear",)),
    # LLaMA's two norms that were bit-exact on the verification inputs stay too: a sample clears nothing
    "qdq_matmul": Expected(TAIL, FULL, ("QuantizeLinear",)),
    # QLinearAdd/QLinearMul inside every norm: each is a candidate, left with the QLinear op that rounds
    "qoperator": Expected(NONE, NONE),
    # the 4-bit kernel computes in float at the default accuracy level: nothing quantizes an activation
    "nbits": Expected(FULL, FULL, quantizes=False),
    # at accuracy_level 4 the kernel quantizes its float input to int8
    "nbits_acc4": Expected(TAIL, FULL, ("MatMulNBits",)),
    "fp16": Expected(FULL, FULL, quantizes=False, dtype="float16"),
    # statistics kept in fp32 by op_block_list (Casts around them) fuse like the plain fp16 ones
    "fp16_blocked": Expected(FULL, FULL, quantizes=False, dtype="float16"),
})
CASES = [(source, recipe) for source in SOURCES for recipe in RECIPES]


def _ids(case: tuple[str, str]) -> str:
    return f"{case[0].split('_')[0]}-{case[1]}"


def _fused_norm_ops(model: onnx.ModelProto) -> dict[str, int]:
    counts = Counter(n.op_type for n in model.graph.node)
    return {op: counts[op] for op in sorted(counts) if op.endswith("LayerNormalization") or op == "RMSNormalization"}


# ---- the properties, each raising AssertionError with what it saw ---------------------------------------------------

def well_formed(fused: onnx.ModelProto) -> None:
    """(a) onnx's full check, unless the model holds an op of ONNX's domain ONNX does not define at its opset (ORT's
    own SimplifiedLayerNormalization, which the checker rejects); ONNX Runtime loads it where it holds ops only ONNX
    Runtime runs."""
    opset = next(o.version for o in fused.opset_import if o.domain in ("", "ai.onnx"))
    ort_only = [n for n in fused.graph.node if only_ort_runs(n.domain, n.op_type, opset)]
    if not any(n.domain in ("", "ai.onnx") for n in ort_only):
        onnx.checker.check_model(fused, full_check=True)
    if ort_only:
        session(fused, optimized=True)


def no_quantizer_input_moves(runs: Runs) -> None:
    """(b) every value a quantizer reads is bitwise the same, on every input set, ORT optimizations off and on."""
    assert runs.watched, "the recipe's model holds quantizers"
    lost = sorted({f"{w.quantizer} reading {w.before!r}" for w in runs.watched if w.after is None})
    assert not lost, f"values quantizers read are gone from the fused model: {lost}"
    for optimized, pairs in (("off", runs.plain), ("on", runs.optimized)):
        for want, got in pairs:
            floats = [w for w in runs.watched if np.issubdtype(want[w.before].dtype, np.floating)]
            assert floats, "the quantizers read float values"
            moved = sorted({f"{w.quantizer} reading {w.before!r}" + (f" (now {w.after!r})" if w.after != w.before
                                                                      else "")
                            for w in floats if want[w.before].dtype != got[w.after].dtype
                            or want[w.before].shape != got[w.after].shape
                            or want[w.before].tobytes() != got[w.after].tobytes()})
            assert not moved, (f"{len(moved)} values entering quantizers moved (ORT optimizations {optimized}, "
                               f"batch and sequence {next(iter(want.values())).shape[:2]}): {moved}")


def outputs_agree(runs: Runs, dtype: str) -> None:
    """(c) the graph outputs, within the tolerance of the dtype the model computes in."""
    for want, got in runs.plain:
        for name in runs.outputs:
            np.testing.assert_allclose(got[name], want[name], **tolerance(dtype), err_msg=name)


def fused_as_expected(result: lnfuse.api.FuseResult, source: str, recipe: str, allow_requantization: bool) -> None:
    """(d) the fused ops of ``EXPECTED``; a norm left because of a quantizer names the quantizer."""
    expected = EXPECTED[recipe]
    want = (expected.allowed if allow_requantization else expected.default)[source]
    got = _fused_norm_ops(result.model)
    assert got == want, f"fused {got}, expected {want}:\n{result.report.explain()}"
    if allow_requantization or not expected.refused_by:
        return
    original = onnx.load(ZOO / zoo_name(source, recipe))
    quantizers = [f"'{n.name}'" for n in original.graph.node if n.op_type in expected.refused_by]
    for candidate in (c for c in result.report.candidates if not c.fused):
        assert any(op in candidate.reason for op in expected.refused_by), f"names no quantizer: {candidate.reason}"
        assert any(name in candidate.reason for name in quantizers), f"names no quantizer: {candidate.reason}"


def every_norm_a_candidate(report: lnfuse.Report, norms: int) -> None:
    """(e) explain and check count every norm of the float model, fused or left."""
    assert len(report.candidates) == norms, f"{len(report.candidates)} candidates, {norms} norms:\n{report.explain()}"


@pytest.fixture(scope="session")
def norms_present() -> dict[str, int]:
    """The norms of each float source: all it reports as candidates, every one of them fused."""
    found = {}
    for source in SOURCES:
        report = lnfuse.fuse(SAMPLES / f"{source}.onnx").report
        assert report.candidates and all(c.fused for c in report.candidates), report.explain()
        found[source] = len(report.candidates)
    return found


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_a_zoo_model_fused_under_the_default_policy(case: tuple[str, str], norms_present: dict[str, int]) -> None:
    """(a) to (e) on one fused model, run once (one test, so that a worker fuses and runs each model once); the
    failure names every property that does not hold."""
    source, recipe = case
    original = onnx.load(ZOO / zoo_name(source, recipe))
    result = lnfuse.fuse(ZOO / zoo_name(source, recipe))
    runs = run_both(original, result.model)
    checks = {
        "(a) well-formed": lambda: well_formed(result.model),
        "(b) no value entering a quantizer moves": lambda: no_quantizer_input_moves(runs),
        "(c) outputs agree": lambda: outputs_agree(runs, EXPECTED[recipe].dtype),
        "(d) fused as the recipe's row says": lambda: fused_as_expected(result, source, recipe, False),
        "(e) every norm is a candidate": lambda: every_norm_a_candidate(result.report, norms_present[source]),
    }
    if not EXPECTED[recipe].quantizes:
        assert not runs.watched, "no quantizer in a recipe that quantizes no activation"
        del checks["(b) no value entering a quantizer moves"]
    failed = {}
    for name, check in checks.items():
        try:
            check()
        except AssertionError as error:
            failed[name] = str(error)
    if failed:
        pytest.fail("\n\n".join(f"{name}: {text}" for name, text in failed.items()), pytrace=False)


@pytest.mark.parametrize("case", [c for c in CASES if EXPECTED[c[1]].refused_by], ids=_ids)
def test_allow_requantization_fuses_what_the_recipe_allows(case: tuple[str, str]) -> None:
    result = lnfuse.fuse(ZOO / zoo_name(*case), allow_requantization=True)
    well_formed(result.model)
    fused_as_expected(result, *case, allow_requantization=True)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_recipes_still_write_these_ops(case: tuple[str, str], tmp_path: Path) -> None:
    """The script, run on the installed ONNX Runtime, writes the ops of the committed model: a quantizer that
    spells a recipe differently fails here, and the zoo is then regenerated and looked at again."""
    again = onnx.load(make(*case, tmp_path))
    assert op_histogram(again) == op_histogram(onnx.load(ZOO / zoo_name(*case)))
