"""The red team's findings on the write side after issue 27's fixes, each kept as a regression: one model's writes
(output, ``<output>.data``, report) never land on another model's output or on a file another model reads; with
``--in-place``, a report never replaces the input's data; a shipped ledger is read a line at a time and a huge one
refused; a mirrored folder blocked by a file is that model's one-line refusal, not an internal error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from zoomodels import external_model, layer_norm_chain


def _lnfuse(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and all(w in lines[0] for w in words), proc.stderr


def _outputs(path: Path) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 2 for d in i.shape])
            .astype(np.float32) for i in session.get_inputs()}
    return session.run(None, feed)


def test_a_report_never_replaces_a_file_another_model_reads(tmp_path: Path):
    """``--in-place --report`` into the models' folder: m's report ``m.onnx.json`` is where x keeps its weights."""
    zoo = tmp_path / "zoo"
    layer_norm_chain(zoo / "m.onnx", 2, hidden=64)
    external_model(zoo, "x.onnx", "m.onnx.json")
    before = _hashes(zoo)
    _one_line(_lnfuse(zoo, "-o", zoo, "--in-place", "--report", zoo, "--jobs", "1"), "m.onnx.json", "x.onnx reads")
    assert _hashes(zoo) == before


def test_a_data_file_never_replaces_a_file_another_model_reads(tmp_path: Path):
    """``--in-place --external-data single``: A's ``A.onnx.data`` is the file B keeps its weights in."""
    zoo = tmp_path / "zoo"
    external_model(zoo, "A.onnx", "a.bin")
    external_model(zoo, "B.onnx", "A.onnx.data")
    before = _hashes(zoo)
    _one_line(_lnfuse(zoo, "-o", zoo, "--in-place", "--external-data", "single", "--jobs", "1"),
              "A.onnx.data", "B.onnx reads")
    assert _hashes(zoo) == before


def test_a_data_file_never_lands_on_another_models_output_or_the_ledger(tmp_path: Path):
    """Inputs ``m.onnx`` and a model named ``m.onnx.data``: m's data file would be the other's output; and a
    ledger named like m's data file."""
    zoo = tmp_path / "zoo"
    external_model(zoo, "m.onnx", "w.bin")
    layer_norm_chain(zoo / "m.onnx.data", 2, hidden=64)
    _one_line(_lnfuse(zoo / "m.onnx", zoo / "m.onnx.data", "-o", tmp_path / "out", "--jobs", "1"), "m.onnx.data")
    (tmp_path / "out2").mkdir()
    _one_line(_lnfuse(zoo / "m.onnx", zoo / "m.onnx", "-o", tmp_path / "out2", "--jobs", "1",
                      "--ledger", tmp_path / "out2" / "m.onnx.data"), "the ledger")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_in_place_a_report_never_replaces_the_inputs_data(tmp_path: Path):
    """A single run: ``--in-place`` allows replacing the model (and the data file ``single`` writes), nothing
    else; a report named like the input's data file is refused as it is without ``--in-place``."""
    model = external_model(tmp_path / "m", "m.onnx", "w.bin")
    before = _hashes(tmp_path / "m")
    _one_line(_lnfuse(model, "-o", model, "--in-place", "--report", tmp_path / "m" / "w.bin"), "w.bin")
    assert _hashes(tmp_path / "m") == before


def test_a_huge_shipped_ledger_is_refused_and_long_lines_skipped(tmp_path: Path):
    """A ledger shipped in the folder fused in place: an 8 GiB sparse one is refused in one line (it was read
    whole: exit 3 under a memory limit); one with a 4 MiB line is read a line at a time, the line ignored."""
    zoo = tmp_path / "zoo"
    layer_norm_chain(zoo / "m.onnx", 2, hidden=64)
    ledger = zoo / "lnfuse-ledger.jsonl"
    with open(ledger, "wb") as f:
        f.truncate(8 << 30)
    _one_line(_lnfuse(zoo, "-o", zoo, "--in-place", "--jobs", "1"), "lnfuse-ledger.jsonl", "not lnfuse's")
    ledger.write_bytes(b'{"input": "' + b"x" * (4 << 20) + b'"}\n')
    proc = _lnfuse(zoo, "-o", zoo, "--in-place", "--jobs", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {row["status"] for row in json.loads(proc.stdout)["models"]} == {"fused"}


def test_a_mirrored_folder_blocked_by_a_file_is_that_models_refusal(tmp_path: Path):
    zoo = tmp_path / "zoo"
    layer_norm_chain(zoo / "a" / "m.onnx", 2, hidden=64)
    layer_norm_chain(zoo / "b" / "m.onnx", 2, hidden=64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_bytes(b"the user's file")
    proc = _lnfuse(zoo, "-o", out, "--jobs", "1", "--json")
    rows = {row["model"]: row for row in json.loads(proc.stdout)["models"]}
    assert proc.returncode == 2 and rows["a/m.onnx"]["status"] == "bad input", rows
    assert "cannot make this folder" in rows["a/m.onnx"]["reason"] and rows["b/m.onnx"]["status"] == "fused"
    assert (out / "a").read_bytes() == b"the user's file"
    np.testing.assert_allclose(_outputs(out / "b" / "m.onnx")[0], _outputs(zoo / "b" / "m.onnx")[0], atol=1e-4)


def test_a_many_model_run_ends_without_a_workers_traceback(tmp_path: Path):
    """Workers are stopped with SIGTERM at the end of a run: one that lands while the worker puts its handler back
    printed a traceback in a third of the runs."""
    zoo = tmp_path / "zoo"
    layer_norm_chain(zoo / "m.onnx", 2, hidden=64)
    (zoo / "bad.onnx").write_bytes(b"not onnx")
    for i in range(4):
        proc = _lnfuse(zoo, "-o", tmp_path / f"out{i}", "--jobs", "2", "-q")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert os.path.isfile(tmp_path / f"out{i}" / "m.onnx")
    onnx.checker.check_model(str(tmp_path / "out0" / "m.onnx"), full_check=True)
