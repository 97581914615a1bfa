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


# -- the review of round 7's fixes ---------------------------------------------------------------------------------

def test_json_nested_past_the_parser_in_a_download_is_no_record(tmp_path: Path):
    """A fake owner file, a model's ``lnfuse.fused`` metadata and a shipped ledger row of nested brackets: each is
    no record (RecursionError ended the run as exit 3)."""
    folder = tmp_path / "dl"
    model = layer_norm_chain(folder / "m.onnx", 2, hidden=64)
    fake = folder / ".0123456789ab.lnfuse-tmp"
    fake.mkdir()
    (fake / ".lnfuse-owner").write_text("[" * 3000)
    proto = onnx.load(model)
    proto.metadata_props.add(key="lnfuse.fused", value="[" * 100_000)
    onnx.save(proto, model)
    proc = _lnfuse(model, "-o", folder / "fused.onnx")
    assert proc.returncode == 0 and fake.is_dir(), proc.stderr
    (folder / "lnfuse-ledger.jsonl").write_text("[" * 985 + "]" * 985 + "\n" + '{"a":' * 900 + "1" + "}" * 900 + "\n")
    proc = _lnfuse(folder, "-o", folder, "--in-place", "--jobs", "1")
    assert proc.returncode == 0 and "not signed" in proc.stderr, proc.stderr


def test_a_report_below_the_models_folder_never_replaces_a_models_data(tmp_path: Path):
    """``--report models/reports``: m's report ``reports/m.onnx.json`` is where n keeps its weights."""
    models = tmp_path / "models"
    layer_norm_chain(models / "m.onnx", 2, hidden=64)
    (models / "reports").mkdir()
    external_model(models, "n.onnx", "reports/m.onnx.json")
    before = _hashes(models)
    _one_line(_lnfuse(models, "-o", tmp_path / "out", "--report", models / "reports", "--jobs", "1"),
              "m.onnx.json", "n.onnx reads")
    assert _hashes(models) == before


def test_options_and_paths_that_used_to_end_as_internal_errors(tmp_path: Path):
    layer_norm_chain(tmp_path / "zoo" / "m.onnx", 2, hidden=64)
    (tmp_path / "afile").write_bytes(b"x")
    for args in (["--timeout", "inf"], ["--timeout", "1e300"], ["--max-memory", "9" * 400],
                 ["--max-memory", "99999999999999999999T"]):
        proc = _lnfuse(tmp_path / "zoo", "-o", tmp_path / "out", "--jobs", "1", *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
    _one_line(_lnfuse(tmp_path / "zoo", "-o", tmp_path / "afile" / "out", "--jobs", "1"), "cannot make this folder")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "ledger.jsonl").mkdir()  # a ledger path lnfuse cannot open for writing
    proc = _lnfuse(tmp_path / "zoo", "-o", tmp_path / "out2", "--jobs", "1", "--ledger", tmp_path / "ro" / "ledger.jsonl")
    assert proc.returncode == 2 and not (tmp_path / "out2" / "m.onnx").exists(), proc.stderr


def test_a_glob_never_follows_a_link_out_of_its_folder(tmp_path: Path):
    """``'dl/*.onnx'`` with ``dl/evil.onnx -> ../private/secret.onnx``: as with the folder given whole, the link is
    not an input; a pattern of thousands of components is a usage error."""
    layer_norm_chain(tmp_path / "dl" / "ok.onnx", 2, hidden=64)
    layer_norm_chain(tmp_path / "private" / "secret.onnx", 2, hidden=64)
    (tmp_path / "dl" / "evil.onnx").symlink_to("../private/secret.onnx")
    proc = _lnfuse(str(tmp_path / "dl") + "/*.onnx", "-o", tmp_path / "out", "--jobs", "1", "--json")
    assert [row["model"] for row in json.loads(proc.stdout)["models"]] == ["ok.onnx"], proc.stdout
    proc = _lnfuse("*/" * 1100 + "x.onnx", "y.onnx", "-o", tmp_path / "out2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def test_a_reader_that_leaves_and_closed_streams_change_nothing(tmp_path: Path):
    layer_norm_chain(tmp_path / "m.onnx", 2, hidden=64)
    for command in ("lnfuse --help | head -1", "lnfuse check --help >&-", "lnfuse nothing.onnx -o o.onnx 2>&-",
                    "lnfuse m.onnx -o fused.onnx -v | head -1"):
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", command.replace(
            "lnfuse", f"{sys.executable} -m lnfuse.cli")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        expected = 2 if "nothing.onnx" in command else 0
        assert proc.returncode == expected and "Traceback" not in proc.stderr, (command, proc.stderr)
    assert (tmp_path / "fused.onnx").is_file()


def test_the_options_recorded_in_the_model_are_the_rule_names(tmp_path: Path):
    import lnfuse

    model = layer_norm_chain(tmp_path / "m.onnx", 2, hidden=64)
    result = lnfuse.fuse(str(model), only="layer_norm")
    options = json.loads({p.key: p.value for p in result.model.metadata_props}["lnfuse.options"])
    assert options["only"] == ["layer_norm"]
