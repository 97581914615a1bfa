"""Many models in one run, as a user runs it: the real CLI, real worker processes, real ONNX Runtime (and a real
local Ray instance when Ray is installed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoomodels import QUICK, copy_samples, external_model, hostile_folder, memory_hog, slow_model


def lnfuse(*args: str, cwd: Path | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def ledger(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "lnfuse-ledger.jsonl").read_text().splitlines()]


def rows_by_model(folder: Path) -> dict[str, dict]:
    return {row["model"]: row for row in ledger(folder)}


def _table(stdout: str) -> str:
    """The closing table without what differs from run to run: wall time and seconds."""
    lines = [line for line in stdout.splitlines() if not line.startswith(("this run:", "seconds:", "wrote "))]
    return re.sub(r"\s\d+\.\d\d\s", " ", "\n".join(lines))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """zoo/a/ (two samples), zoo/b/c/ (two samples), zoo/ext/ (external data), loose/ (two samples)."""
    root = tmp_path_factory.mktemp("zoo")
    copy_samples(root / "zoo" / "a", QUICK[:2])
    copy_samples(root / "zoo" / "b" / "c", QUICK[2:4])
    external_model(root / "zoo" / "ext")
    copy_samples(root / "loose", QUICK[4:6])
    return root


def test_folders_files_globs_and_a_list_mirror_the_input_tree(tree: Path, tmp_path: Path):
    listed = tmp_path / "list.txt"
    listed.write_text(f"# one a line\n{tree / 'loose' / QUICK[5]}\n\n")
    out = tmp_path / "out"
    proc = lnfuse(str(tree / "zoo"), str(tree / "loose" / QUICK[4]), str(tree / "zoo" / "b" / "*" / "*.onnx"),
                  "--from-list", str(listed), "-o", str(out), "--jobs", "2", "--report", str(tmp_path / "reports"))
    assert proc.returncode == 0, proc.stderr
    expected = {f"zoo/a/{QUICK[0]}", f"zoo/a/{QUICK[1]}", f"zoo/b/c/{QUICK[2]}", f"zoo/b/c/{QUICK[3]}",
                "zoo/ext/ext.onnx", f"loose/{QUICK[4]}", f"loose/{QUICK[5]}"}
    rows = rows_by_model(out)
    assert set(rows) == expected, "each model once (the glob's models are the folder's too)"
    assert {r["status"] for r in rows.values()} == {"fused"} and all(r["exit"] == 0 for r in rows.values())
    for relative in expected:
        assert (out / relative).is_file()
    assert (out / "zoo" / "ext" / "ext.onnx.data").is_file() and not (out / "zoo" / "ext" / "ext.data").exists(), \
        "external data beside its output, named from it"
    assert json.loads((tmp_path / "reports" / "zoo" / "ext" / "ext.onnx.json").read_text())["fused_counts"] == \
        {"LayerNormalization": 2}, "--report names a folder of per-model reports"
    assert "models: 7  fused: 7" in proc.stdout and "LayerNormalization" in proc.stdout
    assert re.search(r"^\[ *\d+/7\] fused", proc.stderr, re.M), "plain progress lines when not a terminal"


def test_outputs_are_byte_identical_to_single_model_runs(tree: Path, tmp_path: Path):
    out = tmp_path / "out"
    proc = lnfuse(str(tree / "zoo"), "-o", str(out), "--target", "onnx", "--upgrade-opset", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    for relative in (f"zoo/a/{QUICK[0]}", "zoo/ext/ext.onnx"):
        model = tree / relative
        single = tmp_path / "single" / relative
        single.parent.mkdir(parents=True)
        assert lnfuse(str(model), "-o", str(single), "--target", "onnx", "--upgrade-opset", "-q").returncode == 0
        assert (out / relative.removeprefix("zoo/")).read_bytes() == single.read_bytes(), relative
    assert (out / "ext" / "ext.onnx.data").read_bytes() == \
        (tmp_path / "single" / "zoo" / "ext" / "ext.onnx.data").read_bytes()


def test_a_hostile_folder_fails_alone_with_its_reasons(tree: Path, tmp_path: Path):
    models = tmp_path / "models"
    copy_samples(models / "good", QUICK[:2])
    hostile_folder(models / "hostile", tmp_path / "outside")
    out = tmp_path / "out"
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "2")
    assert proc.returncode == 2, proc.stderr
    rows = rows_by_model(out)
    assert all(rows[f"good/{name}"]["status"] == "fused" for name in QUICK[:2])
    assert "outside the model's folder" in rows["hostile/linked.onnx"]["reason"]
    assert "outside the model's folder" in rows["hostile/absolute.onnx"]["reason"]
    assert "not a readable ONNX model" in rows["hostile/garbage.onnx"]["reason"]
    assert {rows[f"hostile/{n}"]["status"] for n in ("linked.onnx", "absolute.onnx", "garbage.onnx")} == \
        {"bad input"}
    assert not (out / "hostile").exists(), "nothing written for a refused model"
    for name in ("linked.onnx", "absolute.onnx", "garbage.onnx"):
        assert f"hostile/{name}" in proc.stdout, "the table names each failed model"
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_model_past_its_timeout_is_stopped_alone(tmp_path: Path):
    models = tmp_path / "models"
    slow_model(models / "slow.onnx")
    copy_samples(models, QUICK[:3])
    out = tmp_path / "out"
    start = time.monotonic()
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "2", "--timeout", "8")
    assert time.monotonic() - start < 25, "the slow model (about 30 s) was stopped"
    assert proc.returncode == 2, proc.stderr
    rows = rows_by_model(out)
    assert rows["slow.onnx"]["status"] == "timeout" and "--timeout 8 s" in rows["slow.onnx"]["reason"]
    assert rows["slow.onnx"]["sha256"], "its identity was sent before it was stopped"
    assert all(rows[name]["status"] == "fused" for name in QUICK[:3])
    assert not (out / "slow.onnx").exists()


def test_a_model_past_its_memory_limit_fails_alone(tmp_path: Path):
    models = tmp_path / "models"
    memory_hog(models / "hog.onnx")
    copy_samples(models, QUICK[:3])
    out = tmp_path / "out"
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "2", "--max-memory", "1G")
    assert proc.returncode == 2, proc.stderr
    rows = rows_by_model(out)
    assert rows["hog.onnx"]["status"] == "over memory", rows["hog.onnx"]
    assert "memory" in rows["hog.onnx"]["reason"]
    assert all(rows[name]["status"] == "fused" for name in QUICK[:3])
    assert not (out / "hog.onnx").exists(), "an output that depends on the limit is not written"


def _needs_ray() -> None:
    """Skip without Ray; Ray's session folder (/tmp/ray) on the path imports as an empty namespace package."""
    if getattr(pytest.importorskip("ray"), "init", None) is None:
        pytest.skip("ray is not installed")


def test_exit_code_is_the_worst_models(tmp_path: Path):
    from normgraphs import Spec, build
    import onnx

    models = tmp_path / "models"
    copy_samples(models, QUICK[:1])
    onnx.save(build(Spec(mutation="exponent3")), models / "left.onnx")  # a candidate lnfuse must leave
    proc = lnfuse(str(models), "-o", str(tmp_path / "one"), "--jobs", "1")
    alone = lnfuse(str(models / "left.onnx"), "-o", str(tmp_path / "left.onnx"), "-q")
    assert proc.returncode == alone.returncode == 0, proc.stderr + alone.stderr
    assert re.search(r"^0 +candidates left .* left\.onnx", proc.stdout, re.M), "listed, though written"
    (models / "bad.onnx").write_bytes(b"not onnx")
    proc = lnfuse(str(models), "-o", str(tmp_path / "two"), "--jobs", "1", "--json")
    assert proc.returncode == 2
    report = json.loads(proc.stdout)
    assert report["exit"] == 2 and {m["model"]: m["exit"] for m in report["models"]} == \
        {QUICK[0]: 0, "left.onnx": 0, "bad.onnx": 2}


def test_an_output_folder_inside_the_inputs_is_not_an_input(tmp_path: Path):
    models = tmp_path / "models"
    copy_samples(models, QUICK[:2])
    for _ in range(2):
        proc = lnfuse(str(models), "-o", str(models / "fused"), "--jobs", "1")
        assert proc.returncode == 0, proc.stderr
    assert sorted(r["model"] for r in ledger(models / "fused")) == sorted(QUICK[:2]), "its outputs never fused"
    assert "2 model(s) taken from the ledger" in proc.stdout


def test_links_out_of_a_named_folder_are_not_inputs(tmp_path: Path):
    """The user named the folder, not the links in it: a link to a model outside (someone's private model) or to
    /etc/passwd is the folder's, and is not read."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    copy_samples(models, QUICK[:1])
    copy_samples(outside, QUICK[1:2])
    (models / "private.onnx").symlink_to(outside / QUICK[1])
    (models / "passwd.onnx").symlink_to("/etc/passwd")
    proc = lnfuse(str(models), "-o", str(tmp_path / "out"), "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(rows_by_model(tmp_path / "out")) == [QUICK[0]]


def test_usage_errors_are_one_line(tree: Path, tmp_path: Path):
    file = tmp_path / "file"
    file.write_text("")
    for args, said in (([str(tree / "zoo"), "-o", str(file)], "names the output folder"),
                       ([str(tmp_path / "nothing*.onnx"), "-o", str(tmp_path / "o")], "no file matches"),
                       ([str(tree / "loose" / QUICK[4]), "-o", str(tmp_path / "m.onnx"), "--timeout", "5"],
                        "apply to a run over many models")):
        proc = lnfuse(*args)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_a_killed_run_resumes_with_only_the_rest(tmp_path: Path):
    models = tmp_path / "models"
    for copy in range(3):
        copy_samples(models / f"copy{copy}", QUICK[:4])
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", str(models), "-o", str(out), "--jobs", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    book = out / "lnfuse-ledger.jsonl"
    deadline = time.monotonic() + 300
    while not (book.exists() and book.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)  # the run alone: its workers must go with it
    run.wait()
    first = ledger(out)
    assert 2 <= len(first) < 12, "killed halfway"
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    rows = ledger(out)
    assert rows[:len(first)] == first, "finished rows are kept as they were"
    assert sorted(r["model"] for r in rows) == sorted({r["model"] for r in rows}), "no model ran twice"
    assert len(rows) == 12 and f"{len(first)} of 12 model(s) already finished" in proc.stderr
    fresh = lnfuse(str(models), "-o", str(tmp_path / "fresh"), "--jobs", "2")
    assert _table(proc.stdout) == _table(fresh.stdout), "the same final table as a run never stopped"
    again = lnfuse(str(models), "-o", str(out), "--jobs", "2")
    assert len(ledger(out)) == 12 and "12 model(s) taken from the ledger" in again.stdout


def test_ctrl_c_keeps_what_finished(tmp_path: Path):
    models = tmp_path / "models"
    for copy in range(2):
        copy_samples(models / f"copy{copy}", QUICK[:4])
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", str(models), "-o", str(out), "--jobs", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    book = out / "lnfuse-ledger.jsonl"
    deadline = time.monotonic() + 300
    while not (book.exists() and book.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    assert "rerun the same command" in stderr.splitlines()[-1] and "Traceback" not in stderr, stderr
    kept = len(ledger(out))
    assert 1 <= kept < 8 and all((out / row["model"]).is_file() for row in ledger(out))


def test_a_changed_model_or_option_is_done_again(tmp_path: Path):
    models = tmp_path / "models"
    copy_samples(models, QUICK[:2])
    out = tmp_path / "out"
    assert lnfuse(str(models), "-o", str(out), "--jobs", "1").returncode == 0
    shutil.copyfile(models / QUICK[2 - 1], models / QUICK[0])  # same name, other bytes
    assert lnfuse(str(models), "-o", str(out), "--jobs", "1").returncode == 0
    assert [r["model"] for r in ledger(out)][2:] == [QUICK[0]], "only the changed model ran again"
    assert lnfuse(str(models), "-o", str(out), "--jobs", "1", "--target", "onnx", "--upgrade-opset").returncode == 0
    assert len(ledger(out)) == 5, "other options: both again"


def test_progress_bar_on_a_terminal(tmp_path: Path):
    import pty
    models = tmp_path / "models"
    copy_samples(models, QUICK[:2])
    terminal, stderr = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(models), "-o", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, stderr=stderr, timeout=300)
        os.set_blocking(terminal, False)
        drawn = os.read(terminal, 1 << 16).decode()
    finally:
        os.close(stderr)
        os.close(terminal)
    assert proc.returncode == 0
    assert "2/2 done, 0 failed" in drawn and "running" in drawn and "ETA" in drawn
    assert "[1/2] fused" not in drawn, "a bar, not lines"


def test_ray_runs_the_same_jobs(tree: Path, tmp_path: Path):
    _needs_ray()
    models = tmp_path / "models"
    copy_samples(models, QUICK[:3])
    (models / "bad.onnx").write_bytes(b"not onnx")
    local = lnfuse(str(models), "-o", str(tmp_path / "local"), "--jobs", "2")
    ray = lnfuse(str(models), "-o", str(tmp_path / "ray"), "--ray", "--jobs", "2", timeout=600)
    assert ray.returncode == local.returncode == 2, ray.stderr
    assert _table(ray.stdout) == _table(local.stdout)
    for name in QUICK[:3]:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert rows_by_model(tmp_path / "ray")["bad.onnx"]["status"] == "bad input"


def test_one_parse_serves_the_fuse_and_the_hash(tmp_path: Path, monkeypatch):
    """The worker hashes the model's bytes and takes its data files from the fuse's own load: the model is parsed
    once (the output once too, for its own identity), and the identity is the one a listing of the model's own
    finds."""
    from lnfuse.load import io
    from lnfuse.zoo.job import Job, identify, run

    model = external_model(tmp_path / "in")
    parsed = []
    read_proto = io.read_proto
    monkeypatch.setattr(io, "read_proto", lambda path: parsed.append(path) or read_proto(path))
    job = Job(str(model), str(tmp_path / "out" / "ext.onnx"), "ext.onnx")
    row = run(job)
    assert row["status"] == "fused" and parsed == [model, tmp_path / "out" / "ext.onnx"], (row, parsed)
    assert row["sha256"] == identify(job)["sha256"] and row["data_files"] == ["ext.data"]
    assert [key[0] for key in row["stat"]] == ["", "ext.data"] and row["bytes_in"] == \
        model.stat().st_size + (model.parent / "ext.data").stat().st_size
    written = tmp_path / "out" / "ext.onnx"
    assert row["bytes_out"] == written.stat().st_size + (written.parent / "ext.onnx.data").stat().st_size


def test_resume_compares_stat_keys_and_hashes_only_touched_models(tmp_path: Path):
    models = tmp_path / "models"
    copy_samples(models, QUICK[:3])
    external_model(models / "ext")
    out = tmp_path / "out"
    assert lnfuse(str(models), "-o", str(out), "--jobs", "2").returncode == 0
    first = rows_by_model(out)
    shutil.copyfile(models / QUICK[1], models / QUICK[0])  # edited: other bytes
    os.utime(models / QUICK[2])  # touched: same bytes, new mtime
    data = models / "ext" / "ext.data"  # edited in place, its size and mtime put back: only ctime tells
    before = data.stat()
    blob = bytearray(data.read_bytes())
    blob[:4] = bytes(4)  # gamma0[0] = 0.0
    data.write_bytes(bytes(blob))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    rows = ledger(out)[len(first):]
    assert sorted(r["model"] for r in rows) == sorted([QUICK[0], QUICK[2], "ext/ext.onnx"]), \
        "the model whose stat key did not change is not even hashed again"
    again = {r["model"]: r for r in rows}
    assert again[QUICK[0]]["sha256"] != first[QUICK[0]]["sha256"], "the edited model ran again"
    assert again["ext/ext.onnx"]["sha256"] != first["ext/ext.onnx"]["sha256"], "so did the one whose data changed"
    assert (out / "ext" / "ext.onnx.data").read_bytes()[:4] == bytes(4), "the output has the edited weight"
    touched = {k: v for k, v in again[QUICK[2]].items() if k not in ("stat", "signature")}
    assert touched == {k: v for k, v in first[QUICK[2]].items() if k not in ("stat", "signature")}, \
        "the touched model was hashed, found the same, and its row stands with the new stat keys"
    assert "2 model(s) taken from the ledger" in proc.stdout
    third = lnfuse(str(models), "-o", str(out), "--jobs", "2")
    assert "4 model(s) taken from the ledger" in third.stdout and len(ledger(out)) == len(first) + 3


def test_a_data_file_s_zeros_written_as_holes_are_the_same_content(tmp_path: Path, monkeypatch):
    """The identity of a data file is its content: the same bytes with their zeros written out or left as holes
    (``cp --sparse``, a copy to another filesystem) resume as unchanged, and one byte set inside a run of zeros is
    a change. A data file of a terabyte of holes is identified without reading them."""
    from lnfuse.zoo.job import Job, identify

    folder = tmp_path / "in"
    model = external_model(folder)
    data = folder / "ext.data"
    weights = data.read_bytes()
    gap = (3 << 20) + 5  # zeros across whole hashing blocks and parts of two
    with open(data, "r+b") as sparse:  # the gap a hole
        sparse.seek(len(weights) + gap)
        sparse.write(weights)
    with open(data, "rb") as sparse:
        if os.lseek(sparse.fileno(), 0, os.SEEK_HOLE) >= len(weights) + gap:
            pytest.skip("this filesystem does not report holes")
    job = Job(str(model), str(tmp_path / "out" / "m.onnx"), "m.onnx")
    holed = identify(job)
    data.write_bytes(weights + bytes(gap) + weights)  # the same bytes, the zeros written out
    assert identify(job)["sha256"] == holed["sha256"] is not None
    with open(data, "r+b") as edited:
        edited.seek(len(weights) + gap // 2)
        edited.write(b"\1")
    assert identify(job)["sha256"] != holed["sha256"]
    read = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: read.append(n) or pread(fd, n, at))
    with open(data, "r+b") as grown:
        grown.truncate(1 << 40)
    assert identify(job)["sha256"] is not None and sum(read) < 8 << 20, f"{sum(read)} bytes read"


def test_the_data_digest_is_the_documented_encoding(tmp_path: Path):
    """What the ledger's digest of a data file is (docs/zoo.md), so that a change of format is a decision: the
    size, then per 1 MiB block ``D`` and its bytes, or ``Z`` and the length of a run of all-zero blocks."""
    import hashlib

    from lnfuse.zoo.identity import _hash_data

    block = 1 << 20
    content = b"a" * 10 + bytes(block - 10) + bytes(block) + bytes(block) + bytes(10) + b"b"
    path = tmp_path / "w.data"
    path.write_bytes(content)
    expected = hashlib.sha256(len(content).to_bytes(8, "little") + b"D" + content[:block]
                              + b"Z" + (2).to_bytes(8, "little") + b"D" + content[3 * block:])
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        _hash_data(digest, stream.fileno(), len(content))
    assert digest.hexdigest() == expected.hexdigest()


@pytest.mark.parametrize("hostile", ["fifo", "link out", "hard link"])
def test_the_resume_hash_reads_data_files_only_through_the_gate(tmp_path: Path, hostile: str):
    """A model folder turned hostile after a first run: the data file becomes a FIFO (a read would block), a link
    out of the folder, or a hard link to a file outside holding the same bytes (a read would find the same hash,
    and keep a row that is no longer true). The rerun reads none of them and says why."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    external_model(models)
    out = tmp_path / "out"
    assert lnfuse(str(models), "-o", str(out), "--jobs", "1").returncode == 0
    data = models / "ext.data"
    outside.mkdir()
    secret = outside / "secret.data"
    secret.write_bytes(data.read_bytes())
    data.unlink()
    if hostile == "fifo":
        os.mkfifo(data)
    elif hostile == "link out":
        data.symlink_to(secret)
    else:
        os.link(secret, data)
    proc = lnfuse(str(models), "-o", str(out), "--jobs", "1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    row = ledger(out)[-1]
    said = {"fifo": "not a regular file", "link out": "outside the model's folder", "hard link": "hard links"}
    assert row["status"] == "bad input" and said[hostile] in row["reason"], row
    assert row["sha256"] is None and row["data_files"] is None, "no hash of what the gate refused"


def _actors_running_a_model(root: int) -> list[int]:
    """The processes under ``root`` that are Ray actors inside ``Runner.run`` (Ray names them in their command
    line). Only ``root``'s: another run's actors on the same machine are none of this test's business."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit():
                status = Path(f"/proc/{entry}/status").read_text()
                parents[int(entry)] = int(status.split("PPid:")[1].split()[0])
                names[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue

    def under(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    return [pid for pid, name in names.items() if name.startswith(b"ray::Runner.run") and under(pid)]


def test_ray_actors_keep_a_model_s_failure_its_own(tmp_path: Path):
    """On Ray, a model past its time or memory ends its actor's worker, not the actor; an actor that is lost (killed
    here while it holds the slow model) is replaced and its model runs again on the new one."""
    _needs_ray()
    models = tmp_path / "models"
    copy_samples(models, QUICK[:3])
    slow_model(models / "slow.onnx")
    memory_hog(models / "hog.onnx")
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", str(models), "-o", str(out), "--ray", "--jobs", "2",
                            "--timeout", "20", "--max-memory", "1G"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    book = out / "lnfuse-ledger.jsonl"
    deadline = time.monotonic() + 300
    while not (book.exists() and book.read_text().count("\n") >= 4) and time.monotonic() < deadline:
        time.sleep(0.1)
    holding = _actors_running_a_model(run.pid)
    assert len(holding) == 1, "only the slow model is left, on one actor"
    os.kill(holding[0], signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 2, stderr
    rows = rows_by_model(out)
    assert all(rows[name]["status"] == "fused" for name in QUICK[:3])
    assert rows["hog.onnx"]["status"] == "over memory", rows["hog.onnx"]
    assert rows["slow.onnx"]["status"] == "timeout" and rows["slow.onnx"]["sha256"], rows["slow.onnx"]
    assert len(ledger(out)) == 5 and "Traceback" not in stderr
