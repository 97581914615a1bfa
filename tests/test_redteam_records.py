"""Red team: records and deletions a download decides. The many-model run's ledger trusted rows it did not write
(a forged row, whose digests are public functions of public files, made a rerun skip the model and print the row's
counts, or keep a shipped, trojaned file as the reviewed input's "fused" output), and the clean-up of dead runs'
temporary folders deleted a folder shipped beside the model, named and furnished like one, with the model's own
weights in it. Rows and owner files are now signed with a per-user key (``lnfuse.userkey``) the download cannot
hold; each case below was a break before."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import set_external_data
from zoomodels import external_model

from lnfuse import userkey
from lnfuse.cli import main

LEDGER = "lnfuse-ledger.jsonl"
FAKE = ".0123456789ab.lnfuse-tmp"
ROW = "lnfuse ledger row 1"
OWNER = "lnfuse staging owner 1"


def _lnfuse(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _outputs(model: Path) -> np.ndarray:
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 256)).astype(np.float32)}
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _ops(model: Path) -> set[str]:
    return {node.op_type for node in onnx.load(model, load_external_data=False).graph.node}


def _rows(ledger: Path) -> list[dict]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def _attacker_key(tmp_path: Path) -> dict:
    """The environment of a run with another key than the user's: the attacker's own lnfuse."""
    key = tmp_path / "attacker" / "key"
    if not key.exists():
        key.parent.mkdir()
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    return {"LNFUSE_KEY_FILE": str(key)}


def _forge(ledger: Path, key: bytes | None, **fields) -> None:
    """Rewrite the ledger's last row as an attacker can: its input's and output's digests and stat keys computed
    from the files as they are now (public functions of public files; the stat keys are the best guess there is),
    ``fields`` set, and signed with ``key`` (None: no signature)."""
    from lnfuse.zoo.identity import of_model
    from lnfuse.zoo.job import data_files, output_identity

    row = _rows(ledger)[-1]
    source = Path(row["input"])
    row.update({k: v for k, v in of_model(source).complete(data_files(source)).items() if k != "bytes_in"})
    row.update(output_identity=output_identity(Path(row["output"])), **fields)
    row.pop("signature", None)
    if key is not None:
        row["signature"] = userkey.sign(key, ROW, row)
    ledger.write_text(json.dumps(row) + "\n")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# the ledger


def _shipped_with_a_row(tmp_path: Path) -> tuple[Path, Path]:
    """A downloaded folder (its model unfused) shipping the ledger of the attacker's own in-place run: the row is
    shaped by a real run, and the model put back as it was."""
    folder = tmp_path / "download"
    model = external_model(folder)
    pristine = _snapshot(folder)
    assert _lnfuse(str(folder), "-o", str(folder), "--in-place", "--jobs", "1",
                   env=_attacker_key(tmp_path)).returncode == 0
    for name, blob in pristine.items():
        (folder / name).write_bytes(blob)
    return folder, model


@pytest.mark.parametrize("signed_by", ["nobody", "the attacker"])
def test_a_forged_row_in_a_folder_fused_in_place_is_ignored(tmp_path: Path, signed_by: str):
    """``lnfuse DIR -o DIR --in-place`` on a downloaded folder that ships a ledger saying its model is fused (the
    forged counts, 42): the row is ignored with one warning, and the model is fused."""
    folder, model = _shipped_with_a_row(tmp_path)
    attacker = (tmp_path / "attacker" / "key").read_bytes() if signed_by == "the attacker" else None
    _forge(folder / LEDGER, attacker, fused={"LayerNormalization": 42})
    proc = _lnfuse(str(folder), "-o", str(folder), "--in-place", "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "warning: 1 row(s)" in proc.stderr and "not signed by your lnfuse" in proc.stderr, proc.stderr
    assert "taken from the ledger" not in proc.stdout and "42" not in proc.stdout, proc.stdout
    assert "LayerNormalization" in _ops(model), "the model was fused, not skipped"
    assert _rows(folder / LEDGER)[-1]["fused"] == {"LayerNormalization": 2}


def test_the_same_forgery_signed_with_the_user_s_key_would_be_kept(tmp_path: Path):
    """The control: the forged row of the case above, signed with the user's own key, is trusted (the model is
    skipped and stays unfused). Only the signature stands between a download and the user's records."""
    folder, model = _shipped_with_a_row(tmp_path)
    _forge(folder / LEDGER, userkey.user_key(), fused={"LayerNormalization": 42})
    proc = _lnfuse(str(folder), "-o", str(folder), "--in-place", "--jobs", "1")
    assert "1 model(s) taken from the ledger" in proc.stdout and "LayerNormalization" not in _ops(model)


def _trojan(output: Path) -> None:
    """The output's weights replaced by others (size and mtime kept): the same graph computing something else."""
    data = output.with_name(output.name + ".data")
    before = data.stat()
    weights = np.fromfile(data, np.float32)
    (weights * 3 + 1).tofile(data)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("signed_by", ["nobody", "the attacker"])
def test_a_shipped_output_and_row_inside_the_download_are_not_kept(tmp_path: Path, signed_by: str):
    """``lnfuse DL -o DL/out``, the download shipping ``out/`` with a trojaned "fused" output and a row naming it
    the reviewed input's result: the row is ignored, and the output is the input's own fusion."""
    folder = tmp_path / "download"
    model = external_model(folder)
    out = folder / "out"
    assert _lnfuse(str(folder), "-o", str(out), "--jobs", "1", env=_attacker_key(tmp_path)).returncode == 0
    _trojan(out / "ext.onnx")
    key = (tmp_path / "attacker" / "key").read_bytes() if signed_by == "the attacker" else None
    _forge(out / LEDGER, key)
    proc = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert proc.returncode == 0 and "warning: 1 row(s)" in proc.stderr, proc.stderr
    assert "taken from the ledger" not in proc.stdout, proc.stdout
    np.testing.assert_allclose(_outputs(out / "ext.onnx"), _outputs(model), atol=1e-4, rtol=1e-4)


def test_an_output_replaced_after_a_genuine_run_is_fused_again(tmp_path: Path):
    """The user's own row, the output's weights replaced since (size and mtime put back): the output's digest is
    not the one the row recorded, so the model is fused again; an output merely touched is still kept."""
    folder = tmp_path / "models"
    model = external_model(folder)
    out = tmp_path / "out"
    assert _lnfuse(str(folder), "-o", str(out), "--jobs", "1").returncode == 0
    os.utime(out / "ext.onnx.data")  # touched: the same bytes
    touched = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert "1 model(s) taken from the ledger" in touched.stdout and "warning" not in touched.stderr, touched.stderr
    _trojan(out / "ext.onnx")
    again = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert again.returncode == 0 and "taken from the ledger" not in again.stdout, again.stdout
    np.testing.assert_allclose(_outputs(out / "ext.onnx"), _outputs(model), atol=1e-4, rtol=1e-4)
    assert "1 model(s) taken from the ledger" in _lnfuse(str(folder), "-o", str(out), "--jobs", "1").stdout


def test_rows_are_signed_and_a_resume_with_the_user_s_key_keeps_them(tmp_path: Path):
    """Every row carries a signature; the same user's rerun takes them (no warning); another key's does not."""
    folder = tmp_path / "models"
    external_model(folder)
    out = tmp_path / "out"
    assert _lnfuse(str(folder), "-o", str(out), "--jobs", "1").returncode == 0
    row = _rows(out / LEDGER)[0]
    assert userkey.signed(userkey.user_key(), ROW, {k: v for k, v in row.items() if k != "signature"},
                          row["signature"])
    assert row["output_identity"]["data_files"] == ["ext.onnx.data"]
    again = _lnfuse(str(folder), "-o", str(out), "--jobs", "1")
    assert "1 model(s) taken from the ledger" in again.stdout and "warning" not in again.stderr
    other = _lnfuse(str(folder), "-o", str(out), "--jobs", "1", env=_attacker_key(tmp_path))
    assert "taken from the ledger" not in other.stdout and "warning: 1 row(s)" in other.stderr


# the key


def _one_line(proc: subprocess.CompletedProcess, *says: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and all(s in proc.stderr for s in says), proc.stderr


def test_the_key_is_made_once_for_this_user_only(tmp_path: Path):
    folder = tmp_path / "models"
    external_model(folder)
    assert _lnfuse(str(folder), "-o", str(tmp_path / "out"), "--jobs", "1").returncode == 0
    key = Path(os.environ["XDG_CONFIG_HOME"]) / "lnfuse" / "key"
    st = key.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in key.parent.iterdir()) == ["key"], "no draft left beside it"
    blob = key.read_bytes()
    assert _lnfuse(str(folder), "-o", str(tmp_path / "out2"), "--jobs", "1").returncode == 0
    assert key.read_bytes() == blob


@pytest.mark.parametrize("flaw", ["link", "readable by others", "a folder", "a FIFO", "short", "another user's"])
def test_an_unsafe_key_file_is_refused_in_one_line(tmp_path: Path, flaw: str):
    """Anyone who can read the key forges rows, anyone who can replace it makes them: such a key file stops both a
    many-model run and a single one (exit 2, one line, nothing written)."""
    key = tmp_path / "config" / "key"
    key.parent.mkdir()
    real = tmp_path / "real-key"
    real.write_bytes(bytes(32))
    real.chmod(0o600)
    if flaw == "link":
        key.symlink_to(real)
    elif flaw == "readable by others":
        shutil.copyfile(real, key)
        key.chmod(0o644)
    elif flaw == "a folder":
        key.mkdir()
    elif flaw == "a FIFO":
        os.mkfifo(key, 0o600)
    elif flaw == "short":
        key.write_bytes(bytes(8))
        key.chmod(0o600)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        shutil.copyfile(real, key)
        key.chmod(0o600)
        os.chown(key, 65534, 65534)
    env = {"LNFUSE_KEY_FILE": str(key)}
    folder = tmp_path / "models"
    model = external_model(folder)
    _one_line(_lnfuse(str(folder), "-o", str(tmp_path / "out"), "--jobs", "1", env=env), "key file", str(key))
    _one_line(_lnfuse(str(model), "-o", str(tmp_path / "single.onnx"), env=env), "key file")
    assert not (tmp_path / "single.onnx").exists()


def test_without_a_place_for_the_key_a_single_run_still_writes(tmp_path: Path):
    """No key can be made (here: its folder would be under a file): a single run writes its output all the same
    (its temporary folder, unsigned, is then never removed by a later run); a many-model run, whose ledger needs
    the key, says how to give one."""
    (tmp_path / "file").write_bytes(b"")
    env = {"LNFUSE_KEY_FILE": str(tmp_path / "file" / "key")}
    folder = tmp_path / "models"
    model = external_model(folder)
    proc = _lnfuse(str(model), "-o", str(tmp_path / "o.onnx"), env=env)
    assert proc.returncode == 0 and (tmp_path / "o.onnx").exists(), proc.stderr
    _one_line(_lnfuse(str(folder), "-o", str(tmp_path / "out"), "--jobs", "1", env=env), "LNFUSE_KEY_FILE")


# stale temporary folders


def _weights_in_a_fake_staging_folder(folder: Path, owner: bytes) -> Path:
    """A model whose weights lie in a folder named like a dead run's temporary folder, holding an owner file."""
    model = external_model(folder)
    proto = onnx.load(model, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"{FAKE}/ext.data"
    (folder / FAKE).mkdir()
    (folder / "ext.data").rename(folder / FAKE / "ext.data")
    (folder / FAKE / ".lnfuse-owner").write_bytes(owner)
    model.write_bytes(proto.SerializeToString())
    return model


def _owner(kind: str, tmp_path: Path) -> bytes:
    """Owner files a download can ship: the text lnfuse wrote before signatures, or a record naming a dead
    process of this machine, signed with the attacker's key (a signature of the user's key cannot be made)."""
    if kind == "old text":
        return b"lnfuse staging folder\n"
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    record = {"folder": FAKE, "inode": [0, 0], "host": socket.gethostname(),
              "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "pid": gone, "start": 1}
    attacker = tmp_path / "attacker-key"
    attacker.write_bytes(os.urandom(32))
    record["signature"] = userkey.sign(attacker.read_bytes(), OWNER, record)
    return json.dumps(record).encode()


@pytest.mark.parametrize("owner", ["old text", "attacker-signed"])
@pytest.mark.parametrize("where", ["beside the model", "in place"])
def test_a_shipped_fake_staging_folder_holding_the_weights_is_not_deleted(tmp_path: Path, owner: str, where: str):
    folder = tmp_path / "download"
    folder.mkdir()
    model = _weights_in_a_fake_staging_folder(folder, _owner(owner, tmp_path))
    expected = _outputs(model)
    weights = (folder / FAKE / "ext.data").read_bytes()
    output = folder / "fused.onnx" if where == "beside the model" else model
    assert main([str(model), "-o", str(output), "-q"] + (["--in-place"] if where == "in place" else [])) == 0
    assert (folder / FAKE / "ext.data").read_bytes() == weights, "the download's weights are still there"
    np.testing.assert_allclose(_outputs(output), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("owner", ["old text", "attacker-signed"])
def test_a_fake_staging_folder_carried_into_the_output_folder_survives_the_next_run(tmp_path: Path, owner: str):
    """The model keeps its weights, and the owner file with them (a tensor of its bytes), in a fake staging folder.
    Copied under the model's names, that folder once landed in the user's output folder, where the user's next,
    unrelated run could take it for a dead run's. Now nothing the model names is a path written: the weights go to
    ``first.onnx.data``, and the next run leaves the first output whole."""
    folder = tmp_path / "download"
    folder.mkdir()
    model = _weights_in_a_fake_staging_folder(folder, _owner(owner, tmp_path))
    text = (folder / FAKE / ".lnfuse-owner").read_bytes()
    proto = onnx.load(model, load_external_data=False)  # the owner file is also a uint8 weight the graph reads
    tensor = numpy_helper.from_array(np.frombuffer(text, np.uint8), "owner")
    set_external_data(tensor, f"{FAKE}/.lnfuse-owner", 0, len(text))
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    proto.graph.initializer.append(tensor)
    proto.graph.node.append(onnx.helper.make_node("Size", ["owner"], ["owner_size"]))
    proto.graph.output.append(onnx.helper.make_tensor_value_info("owner_size", TensorProto.INT64, []))
    model.write_bytes(proto.SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    assert main([str(model), "-o", str(out / "first.onnx"), "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["first.onnx", "first.onnx.data"], "no folder the model named"
    expected = _outputs(out / "first.onnx")
    assert main([str(external_model(tmp_path / "other")), "-o", str(out / "second.onnx"), "-q"]) == 0
    np.testing.assert_allclose(_outputs(out / "first.onnx"), expected)


def test_a_real_owner_file_copied_into_another_folder_is_not_trusted(tmp_path: Path):
    """A genuine owner file of a dead run, signed with the user's key, copied with its folder elsewhere (the same
    name, another inode): not the folder its run made, so it is kept."""
    out = tmp_path / "out"
    (tmp_path / "first").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _DYING_RUN, str(tmp_path / "first")], stdout=subprocess.PIPE,
                            text=True)
    stale = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    out.mkdir()
    copied = out / stale.name
    shutil.copytree(stale, copied)
    assert main([str(external_model(tmp_path / "m")), "-o", str(out / "o.onnx"), "-q"]) == 0
    assert copied.is_dir(), "a copy is not the folder the run made"
    assert main([str(tmp_path / "m" / "ext.onnx"), "-o", str(tmp_path / "first" / "o.onnx"), "-q"]) == 0
    assert not stale.exists(), "the genuine one, where its run left it, is removed"


_DYING_RUN = """
import sys, time
from pathlib import Path
from lnfuse.save.staging import Staging
area = Staging().area(Path(sys.argv[1]))
print(area, flush=True)
time.sleep(300)
"""


def test_a_real_lnfuse_killed_mid_save_is_cleaned_up_by_the_next_run(tmp_path: Path):
    """SIGKILL of a real ``lnfuse`` while it writes a 256 MiB data file: its temporary folder stays behind, and the
    next run writing to that folder removes it (its owner file is signed, its process gone, its lock free)."""
    model = external_model(tmp_path / "m")
    proto = onnx.load(model, load_external_data=False)
    big = TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[1 << 26], raw_data=b"\0")
    set_external_data(big, "big.data", 0, 1 << 28)
    big.ClearField("raw_data")
    big.data_location = TensorProto.EXTERNAL
    proto.graph.initializer.append(big)
    proto.graph.node.append(onnx.helper.make_node("Size", ["big"], ["n"]))
    proto.graph.output.append(onnx.helper.make_tensor_value_info("n", TensorProto.INT64, []))
    with open(tmp_path / "m" / "big.data", "wb") as f:  # real bytes: holes would be copied in no time
        for _ in range(16):
            f.write(b"\x01" * (1 << 24))
    model.write_bytes(proto.SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", str(model), "-o", str(out / "o.onnx"),
                             "--external-data", "single", "-q"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not list(out.glob(".*.lnfuse-tmp/*.data")):
        time.sleep(0.005)
    assert proc.poll() is None, "the write finished before the run could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    stale = list(out.glob(".*.lnfuse-tmp"))
    assert len(stale) == 1 and not (out / "o.onnx").exists()
    assert main([str(external_model(tmp_path / "other")), "-o", str(out / "second.onnx"), "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["second.onnx", "second.onnx.data"], \
        "the dead run's folder is gone"


def test_the_key_file_is_never_read_as_a_models_data(tmp_path: Path):
    """A model folder that holds the key (a run on ``~/.config``) naming ``lnfuse/key`` as external data: refused,
    so the key is never copied into an output."""
    config = tmp_path / "config"
    key = config / "lnfuse" / "key"
    env = dict(os.environ, LNFUSE_KEY_FILE=str(key))
    model = external_model(config, "m.onnx", "m.data")
    proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(model), "-o", str(tmp_path / "warm.onnx"), "-q"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and key.is_file(), proc.stderr  # the run made the key (it signs its owner file)
    proto = onnx.load(model, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "lnfuse/key"
    onnx.save(proto, model)
    proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", str(model), "-o", str(tmp_path / "out.onnx")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "key file" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "out.onnx.data").exists()


def test_a_dead_runs_folder_holding_what_this_run_reads_is_kept(tmp_path: Path):
    """A genuine dead run's folder (signed with the user's key, its process gone) that holds the data file of the
    model being fused: not removed before the weights are read, and not after."""
    folder = tmp_path / "download"
    folder.mkdir()
    model = _weights_in_a_fake_staging_folder(folder, b"")
    st = os.lstat(folder / FAKE)
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    record = {"folder": FAKE, "inode": [st.st_dev, st.st_ino], "host": socket.gethostname(),
              "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "pid": gone, "start": 1}
    record["signature"] = userkey.sign(userkey.user_key(), OWNER, record)
    (folder / FAKE / ".lnfuse-owner").write_bytes(json.dumps(record).encode())
    expected = _outputs(model)
    assert main([str(model), "-o", str(folder / "fused.onnx"), "-q"]) == 0
    assert (folder / FAKE / "ext.data").is_file(), "a file this run reads is never deleted"
    np.testing.assert_allclose(_outputs(folder / "fused.onnx"), expected, atol=1e-4, rtol=1e-4)
