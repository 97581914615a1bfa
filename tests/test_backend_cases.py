"""The ONNX backend test suite's expanded LayerNormalization / RMSNormalization cases (the ops' own function bodies
inlined): each becomes one fused node with no ReduceMean left and reproduces the suite's expected outputs in ORT."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import lnfuse
from normgraphs import op_types, session

FUSED = {"LayerNormalization", "RMSNormalization"}


def _cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases
        cases = collect_testcases(None)
    return sorted((c for c in cases
                   if ("layer_normalization" in c.name or "rms_normalization" in c.name)
                   and (c.name.endswith("_expanded") or c.name.endswith("_expanded_ver18"))),
                  key=lambda c: c.name)


CASES = _cases()


def test_all_57_cases_are_collected():
    assert len(CASES) == 57


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_expanded_case_fuses_to_one_node(case, target):
    result = lnfuse.fuse(case.model, target=target)
    fused = result.model
    ops = op_types(fused)
    assert "ReduceMean" not in ops
    assert sum(op in FUSED for op in ops) == 1, ops
    assert len(ops) == 1, f"shape bookkeeping left behind: {ops}"
    onnx.checker.check_model(fused, full_check=True)
    sess = session(fused)
    names = [i.name for i in sess.get_inputs()]
    for inputs, expected in case.data_sets:
        got = sess.run(None, dict(zip(names, inputs)))
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-3)
