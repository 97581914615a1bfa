"""Red team, round 6: the many-models run's files (the ledger, explicit inputs, what a resume trusts) and sparse
data files (where the system's answers about holes are wrong, or a file is far larger than the tensor it holds).
Each case was a break: a resume that kept an output for other weights, a ledger written outside the output folder
or blocking on a FIFO, an input replaced by another model's output, a copy that never ended, a model refused for
the size of a file it reads 1 KB of."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from zoomodels import external_model

from lnfuse.cli import main


def _lnfuse(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, timeout=300)


def _outputs(model: Path) -> np.ndarray:
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 256)).astype(np.float32)}
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _one_line(proc: subprocess.CompletedProcess, says: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr


def test_a_data_file_reached_through_a_link_is_the_link(tmp_path: Path):
    """The ledger names a data file as the model does: pointing the link at other weights is a change, and the
    rerun fuses the model again instead of keeping an output made from the old ones."""
    folder = tmp_path / "m"
    model = external_model(folder)
    (folder / "ext.data").rename(folder / "v1.data")
    weights = np.fromfile(folder / "v1.data", np.float32)
    (weights * 3 + 1).tofile(folder / "v2.data")
    (folder / "ext.data").symlink_to("v1.data")
    out = tmp_path / "out"
    assert _lnfuse(str(folder), "-o", str(out), "--jobs", "1").returncode == 0
    (folder / "ext.data").unlink()
    (folder / "ext.data").symlink_to("v2.data")
    again = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert again.returncode == 0 and "taken from the ledger" not in again.stdout, again.stdout
    np.testing.assert_allclose(_outputs(out / "ext.onnx"), _outputs(model), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("when", ["before the hash", "during the hash"])
def test_weights_written_after_the_fuse_read_them_leave_no_identity(tmp_path: Path, monkeypatch, when: str):
    """A data file written to after the fuse read it, before or while the ledger hashes it: the hash is not of what
    was fused, so the row records no identity, and a rerun fuses the model again."""
    from lnfuse.zoo import identity, job
    from lnfuse.zoo.job import Job, run

    model = external_model(tmp_path / "m")
    data = tmp_path / "m" / "ext.data"

    def write() -> None:  # a concurrent writer
        with open(data, "r+b") as writer:
            writer.write(np.float32(7).tobytes())

    hook, name = (job, "_read_files") if when == "before the hash" else (identity, "_hash_data")
    original = getattr(hook, name)
    monkeypatch.setattr(hook, name, lambda *args: write() or original(*args))
    row = run(Job(str(model), str(tmp_path / "out" / "ext.onnx"), "ext.onnx"))
    assert row["status"] == "fused" and row["sha256"] is None and row["data_files"] is None, row


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_the_ledger_is_only_a_regular_file_of_its_own(tmp_path: Path, kind: str):
    """A ledger path that is a FIFO (a read would block) or a link (rows would be appended wherever it points):
    refused in one line, nothing written through it."""
    folder = tmp_path / "m"
    external_model(folder)
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(out / "lnfuse-ledger.jsonl")
    else:
        (out / "lnfuse-ledger.jsonl").symlink_to(outside)
    proc = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    _one_line(proc, "--ledger")
    assert outside.read_text() == "mine\n"


def test_a_model_named_inside_the_output_folder_is_refused(tmp_path: Path):
    """Outputs mirror the inputs under -o: a model named there could be replaced by another model's output or
    its data (a kept data file of the same name), and be fused from those."""
    external_model(tmp_path / "m", "b.onnx")
    inside = external_model(tmp_path / "o" / "m", "a.onnx")
    before = (inside.parent / "ext.data").stat()
    proc = _lnfuse(str(tmp_path / "m" / "b.onnx"), str(inside), "-o", str(tmp_path / "o"), "--jobs", "1")
    _one_line(proc, "inside the output folder")
    after = (inside.parent / "ext.data").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_link_in_the_output_folder_to_a_model_elsewhere_is_refused(tmp_path: Path):
    """The model's data files are read beside the name given: a link inside -o to a model outside still reads its
    data inside -o, where another model's kept data could replace it. Named, it is refused; found in a folder that
    holds the output folder, it is skipped like the outputs."""
    elsewhere = external_model(tmp_path / "elsewhere", "a.onnx")
    out = tmp_path / "zoo" / "out"
    (out / "m").mkdir(parents=True)
    (out / "m" / "a.onnx").symlink_to(elsewhere)
    external_model(tmp_path / "zoo" / "m", "b.onnx")
    _one_line(_lnfuse(str(out / "m" / "a.onnx"), str(tmp_path / "zoo" / "m" / "b.onnx"), "-o", str(out)),
              "inside the output folder")
    (tmp_path / "zoo" / "c.onnx").symlink_to(out / "m" / "a.onnx")  # a link from the inputs into the outputs
    proc = _lnfuse(str(tmp_path / "zoo"), "-o", str(out), "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "lnfuse-ledger.jsonl").read_text().splitlines()]
    assert [row["model"] for row in rows] == ["m/b.onnx"], rows


def test_a_row_of_the_earlier_identity_is_not_trusted(tmp_path: Path):
    """Rows written before data files were named as the model names them may name a link's old target: a rerun
    fuses their models again rather than trusting them."""
    folder = tmp_path / "m"
    external_model(folder)
    out = tmp_path / "out"
    assert _lnfuse(str(folder), "-o", str(out), "--jobs", "1").returncode == 0
    ledger = out / "lnfuse-ledger.jsonl"
    row = json.loads(ledger.read_text())
    del row["identity"]
    ledger.write_text(json.dumps(row) + "\n")
    again = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert again.returncode == 0 and "taken from the ledger" not in again.stdout, again.stdout


def test_a_model_file_written_between_its_hash_and_its_parse_leaves_no_identity(tmp_path: Path, monkeypatch):
    """The model file is hashed before it is parsed: one written to in between (even written back) leaves its row
    with no identity, so a rerun fuses it again rather than trusting a hash of other bytes."""
    import lnfuse.api
    from lnfuse.zoo.job import Job, run

    model = external_model(tmp_path / "m")
    fuse = lnfuse.api.fuse

    def rewritten(*args, **kwargs):
        model.write_bytes(model.read_bytes())
        return fuse(*args, **kwargs)

    monkeypatch.setattr(lnfuse.api, "fuse", rewritten)
    row = run(Job(str(model), str(tmp_path / "out" / "ext.onnx"), "ext.onnx"))
    assert row["status"] == "fused" and row["sha256"] is None, row


_BACKWARDS = """
import os, sys
seek = os.lseek
def backwards(fd, position, how):
    if how == os.SEEK_DATA:
        return 0
    if how == os.SEEK_HOLE:
        return 4096
    return seek(fd, position, how)
os.lseek = backwards
from lnfuse.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_filesystem_whose_hole_answers_go_backwards_still_copies(tmp_path: Path):
    """SEEK_DATA answered with an offset before the one asked (a FUSE or NFS server's answer, passed through
    unchecked): the weights are still copied into ``<output>.data``, and the copy ends (in a process of its own, so
    that a copy that loops fails the test instead of hanging it)."""
    model = external_model(tmp_path / "m")
    os.truncate(tmp_path / "m" / "ext.data", 64 << 10)
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-c", _BACKWARDS, str(model), "-o", str(tmp_path / "out" / "ext.onnx"),
                           "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(_outputs(tmp_path / "out" / "ext.onnx"), _outputs(model), atol=1e-4, rtol=1e-4)


_UNDER_ADDRESS_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
from lnfuse.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_tensor_in_a_terabyte_file_maps_only_its_own_pages(tmp_path: Path):
    """A 1 KB tensor at the start of a 1 TiB sparse data file, under an 8 GB address-space limit (a cluster's
    h_vmem): only the tensor's pages are mapped, so the model fuses; the output's data file holds only the bytes
    the model reads."""
    model = external_model(tmp_path / "m")
    data = tmp_path / "m" / "ext.data"
    os.truncate(data, 1 << 40)
    with open(data, "rb") as file:
        if os.lseek(file.fileno(), 0, os.SEEK_HOLE) >= 1 << 40:
            pytest.skip("this filesystem does not keep holes")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", _UNDER_ADDRESS_LIMIT, str(model), "-o", str(out / "ext.onnx"),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fused"], proc.stdout
    assert (out / "ext.onnx.data").stat().st_size < 1 << 20


def test_holes_the_filesystem_cannot_report_are_not_written_out(tmp_path: Path, monkeypatch):
    """A filesystem without SEEK_DATA (NFSv3, some FUSE mounts) holding a sparse data file: the copy beside the
    output holds only the ranges the model reads, not a gigabyte of zeros."""
    model = external_model(tmp_path / "m")
    data = tmp_path / "m" / "ext.data"
    os.truncate(data, 1 << 30)
    if data.stat().st_blocks * 512 >= 1 << 30:
        pytest.skip("this filesystem does not keep holes")
    seek = os.lseek

    def no_map(fd, position, how):
        if how in (os.SEEK_DATA, os.SEEK_HOLE):
            raise OSError(errno.EINVAL, "Invalid argument")
        return seek(fd, position, how)

    monkeypatch.setattr(os, "lseek", no_map)
    (tmp_path / "out").mkdir()
    assert main([str(model), "-o", str(tmp_path / "out" / "ext.onnx"), "-q"]) == 0
    copied = tmp_path / "out" / "ext.onnx.data"
    assert copied.stat().st_size < 1 << 20
    np.testing.assert_allclose(_outputs(tmp_path / "out" / "ext.onnx"), _outputs(model), atol=1e-4, rtol=1e-4)


def test_a_failure_over_files_that_changed_meanwhile_leaves_no_identity(tmp_path: Path, monkeypatch):
    """A fuse that failed while a data file was being written (truncated, then completed): the files as they are
    after the failure are not what failed, so the failure's row records no identity and a rerun tries again."""
    import lnfuse.api
    from lnfuse.errors import InputError
    from lnfuse.zoo.job import Job, run

    model = external_model(tmp_path / "m")
    data = tmp_path / "m" / "ext.data"

    def fails_mid_write(*args, **kwargs):
        data.write_bytes(data.read_bytes())  # what a copy into place does while the fuse reads
        raise InputError(f"{model}: external data 'ext.data' is shorter than its tensors")

    monkeypatch.setattr(lnfuse.api, "fuse", fails_mid_write)
    row = run(Job(str(model), str(tmp_path / "out" / "ext.onnx"), "ext.onnx"))
    assert row["status"] == "bad input" and row["sha256"] is None, row


def test_a_data_file_named_like_a_model_output_or_the_ledger_lands_on_neither(tmp_path: Path):
    """A model whose data file is named like another input model or like the ledger: its weights go to its own
    ``<output>.data``, so the other model's output and the ledger are as they should be."""
    import onnx
    from zoomodels import layer_norm_chain

    zoo = tmp_path / "zoo"
    layer_norm_chain(zoo / "y.onnx", 2, hidden=256)
    external_model(zoo, "x.onnx", "x.data")
    x = onnx.load(zoo / "x.onnx", load_external_data=False)
    for tensor in x.graph.initializer:  # its weights read from the bytes of y.onnx
        for entry in tensor.external_data:
            entry.value = {"location": "y.onnx", "offset": "0"}.get(entry.key, entry.value)
    onnx.save(x, zoo / "x.onnx")
    (zoo / "x.data").unlink()
    external_model(zoo, "z.onnx", "lnfuse-ledger.jsonl")
    out = tmp_path / "out"
    proc = _lnfuse(str(zoo), "-o", str(out), "--jobs", "1", "--json")
    rows = {row["model"]: row for row in json.loads(proc.stdout)["models"]}
    assert all(row["status"] != "bad input" for row in rows.values()), rows
    assert (out / "x.onnx.data").is_file() and (out / "z.onnx.data").is_file()
    assert (out / "y.onnx").read_bytes() != (zoo / "y.onnx").read_bytes(), "y's output is y fused, not x's data"
    ledger = [json.loads(line) for line in (out / "lnfuse-ledger.jsonl").read_text().splitlines()]
    assert sorted(row["model"] for row in ledger) == ["x.onnx", "y.onnx", "z.onnx"]


def test_outputs_that_are_the_ledger_or_each_other_are_refused(tmp_path: Path):
    """A model named like the ledger would be written over it: refused in one line before anything runs."""
    external_model(tmp_path / "zoo")
    (tmp_path / "zoo" / "ext.onnx").rename(tmp_path / "zoo" / "lnfuse-ledger.jsonl")
    _one_line(_lnfuse(str(tmp_path / "zoo" / "lnfuse-ledger.jsonl"), str(tmp_path / "zoo" / "lnfuse-ledger.jsonl"),
                      "-o", str(tmp_path / "out")), "the ledger")


def test_a_link_in_the_output_folder_does_not_take_the_writes_out(tmp_path: Path):
    """The output tree mirrors the inputs; a link already there, to a folder elsewhere, is not written through."""
    external_model(tmp_path / "zoo" / "sub")
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere)
    proc = _lnfuse(str(tmp_path / "zoo"), "-o", str(out), "--jobs", "1")
    assert proc.returncode == 2 and "leads out of it" in proc.stdout + proc.stderr, proc.stdout
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "device", "nul"])
def test_a_list_of_models_is_a_regular_text_file(tmp_path: Path, kind: str):
    """--from-list naming a FIFO (a read blocks), a device (a read never ends) or a file with a NUL byte: one line,
    exit 2, nothing run."""
    external_model(tmp_path / "m")
    listed = tmp_path / "list.txt"
    if kind == "fifo":
        os.mkfifo(listed)
    elif kind == "device":
        listed = Path("/dev/zero")
    else:
        listed.write_bytes(str(tmp_path / "m" / "ext.onnx").encode() + b"\0\n")
    _one_line(_lnfuse(str(tmp_path / "m"), "--from-list", str(listed), "-o", str(tmp_path / "out")), "--from-list")


def test_a_ledger_row_of_the_wrong_shape_is_ignored(tmp_path: Path):
    """A hand-edited row (an exit code that is a string, a count that is not a number): not trusted, and its
    model runs again; never an internal error or a wrong exit code."""
    external_model(tmp_path / "m")
    out = tmp_path / "out"
    assert _lnfuse(str(tmp_path / "m"), "-o", str(out), "--jobs", "1").returncode == 0
    ledger = out / "lnfuse-ledger.jsonl"
    row = json.loads(ledger.read_text())
    for forged in ({"exit": "0"}, {"exit": 7}, {"fused": 5}):
        ledger.write_text(json.dumps({**row, **forged}) + "\n")
        again = _lnfuse(str(tmp_path / "m"), "-o", str(out), "--jobs", "1")
        assert again.returncode == 0 and "taken from the ledger" not in again.stdout, (forged, again.stderr)


def test_a_dotdot_after_a_link_is_the_kernel_s(tmp_path: Path):
    """``zoo/lnk/../m.onnx`` with ``lnk`` a link to ``other/dir`` is ``other/m.onnx`` to the kernel and to a single
    run: the many-model run fuses that file, named or globbed, not the ``m.onnx`` beside the link."""
    from zoomodels import layer_norm_chain

    layer_norm_chain(tmp_path / "zoo" / "m.onnx", 1)
    layer_norm_chain(tmp_path / "other" / "m.onnx", 3)
    (tmp_path / "other" / "dir").mkdir()
    (tmp_path / "zoo" / "lnk").symlink_to(tmp_path / "other" / "dir")
    for entry, out in ((str(tmp_path / "zoo" / "lnk" / ".." / "m.onnx"), tmp_path / "named"),
                       (str(tmp_path / "zoo" / "lnk" / ".." / "*.onnx"), tmp_path / "globbed")):
        proc = _lnfuse(entry, "-o", str(out), "--jobs", "1", "--json")
        assert proc.returncode == 0, proc.stderr
        [row] = json.loads(proc.stdout)["models"]
        assert row["input"] == str(tmp_path / "other" / "m.onnx") and row["fused"] == {"LayerNormalization": 3}, row


def test_a_model_name_with_control_characters_prints_on_one_line(tmp_path: Path):
    """A file name holding a newline or an escape sequence: each progress line and table row stays one line."""
    folder = tmp_path / "zoo"
    external_model(folder)
    (folder / "ext.onnx").rename(folder / "a\nb\x1b[2J.onnx")
    proc = _lnfuse(str(folder), "-o", str(tmp_path / "out"), "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr and "a\\nb\\x1b[2J.onnx" in proc.stderr, proc.stderr
