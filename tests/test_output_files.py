"""Outputs are regular files, written whole or not at all. Every path lnfuse writes (``-o``, ``--report``,
``explain --annotate``, ``decompose -o``, the data files beside them) naming a device, FIFO, socket, folder or a link
to one is refused with one line (exit 2) before anything is written, and again when the staged files are renamed.
A leftover staging folder whose owner file is a FIFO is skipped, not opened. ``--in-place`` on a model whose
external data lies in the model file itself reads those bytes before the file is replaced.

Each case checks: exit 0 with an output ONNX Runtime loads, or exit 2 with exactly one line on stderr; nothing
changed outside the output's folder; the input unchanged (hashes) unless it was replaced as asked; no staging
folder left behind."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.external_data_helper import set_external_data

from lnfuse.cli import main
from lnfuse.errors import OutputError
from lnfuse.save.staging import Staging
from normgraphs import Spec, build

#: an unknown field number of ModelProto: protobuf parsers (onnx's, ONNX Runtime's) skip it
_TRAILER_FIELD = 999


def _run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed command as a separate process; the timeout turns a run that blocks into a failure."""
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("lnfuse: error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and all(w in err for w in words), err


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` and what it is, without opening anything but regular files (a FIFO would
    block)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                found[str(path)] = "-> " + os.readlink(path)
            elif stat.S_ISREG(mode):
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = stat.filemode(mode)
    return found


def _staging_left(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.lnfuse-tmp")]


def _outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _random_feeds(path: Path) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    return {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in session.get_inputs()}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _self_contained(path: Path, location: str | None = None, constant: bool = False) -> Path:
    """A LayerNorm model whose gamma and beta (random, 64 floats each) are external data at ``location`` (by default
    the model file's own name) and lie in the model file itself: after the protobuf, inside one field of a number
    ModelProto does not define, so that the file still parses and the bytes sit at a known offset. ``constant``:
    gamma is the value of a Constant node instead of an initializer."""
    model = build(Spec(hidden=64))
    rng = np.random.default_rng(0)
    weights = [(t, rng.standard_normal(64).astype(np.float32).tobytes()) for t in model.graph.initializer
               if t.name.startswith(("gamma", "beta"))]
    if constant:
        gamma = weights[0][0]
        model.graph.initializer.remove(gamma)
        node = onnx.helper.make_node("Constant", [], [gamma.name], value=gamma)
        model.graph.node.insert(0, node)
        weights[0] = (node.attribute[0].t, weights[0][1])
    for tensor, raw in weights:
        tensor.raw_data = raw
        set_external_data(tensor, location or path.name, 0, len(raw))
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL

    def serialized(offsets: list[int]) -> bytes:
        for (tensor, _), offset in zip(weights, offsets):
            # fixed width, so that the offsets written do not change the length they depend on
            next(e for e in tensor.external_data if e.key == "offset").value = str(offset).zfill(12)
        return model.SerializeToString()

    payload = b"".join(raw for _, raw in weights)
    header = _varint(_TRAILER_FIELD << 3 | 2) + _varint(len(payload))
    start = len(serialized([0] * len(weights))) + len(header)
    offsets = list(np.cumsum([0] + [len(raw) for _, raw in weights[:-1]]) + start)
    path.write_bytes(serialized(offsets) + header + payload)
    return path


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch) -> Path:
    """model/ holding a plain model.onnx, and out/ (the output folder); the working directory is the sandbox, so
    that a socket's path stays within the 107 bytes AF_UNIX allows."""
    for name in ("model", "out"):
        (tmp_path / name).mkdir()
    onnx.save(build(Spec(hidden=64)), tmp_path / "model" / "model.onnx")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _special(kind: str, path: Path, sandbox: Path) -> None:
    """Make ``path`` a special file (or a link to one) of the given kind."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(os.path.relpath(path))
        server.close()  # the socket file stays
    elif kind == "folder":
        path.mkdir()
    elif kind == "link_to_fifo":
        os.mkfifo(sandbox / "a_fifo")
        path.symlink_to(sandbox / "a_fifo")
    elif kind == "link_to_socket":
        _special("socket", sandbox / "a_socket", sandbox)
        path.symlink_to(sandbox / "a_socket")
    elif kind == "link_to_dev_null":
        path.symlink_to("/dev/null")
    elif kind == "link_to_folder":
        (sandbox / "a_folder").mkdir()
        path.symlink_to(sandbox / "a_folder", target_is_directory=True)
    elif kind == "link_to_stdout":  # /dev/stdout's own kind of link, in a folder of the test's
        path.symlink_to("/proc/self/fd/1")
    else:
        raise AssertionError(kind)


def _command(option: str, model: Path, path: Path, out: Path) -> list:
    """The command line writing ``path`` through ``option`` (the other outputs, if any, go to ``out``)."""
    return {"-o": [model, "-o", path, "-q"],
            "--report": [model, "-o", out / "fused.onnx", "--report", path, "-q"],
            "--annotate": ["explain", model, "--annotate", path],
            "decompose -o": ["decompose", model, "-o", path, "-q"]}[option]


KINDS = ("fifo", "socket", "folder", "link_to_fifo", "link_to_socket", "link_to_dev_null", "link_to_folder",
         "link_to_stdout")
OPTIONS = ("-o", "--report", "--annotate", "decompose -o")


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_output_that_is_not_a_regular_file_is_refused(sandbox: Path, capsys, option: str, kind: str):
    target = sandbox / "out" / "special"
    _special(kind, target, sandbox)
    before = _tree(sandbox)
    code, err = _run(capsys, *_command(option, sandbox / "model" / "model.onnx", target, sandbox / "out"))
    _refused(code, err, str(target))
    assert _tree(sandbox) == before, "nothing written, nothing replaced"
    assert not _staging_left(sandbox)


@pytest.mark.parametrize("option", OPTIONS)
def test_dev_null_itself_is_refused_and_stays_a_device(sandbox: Path, capsys, option: str):
    """As root, a rename over /dev/null replaces the device for every program on the machine."""
    before = os.lstat("/dev/null")
    try:
        code, err = _run(capsys, *_command(option, sandbox / "model" / "model.onnx", Path("/dev/null"),
                                           sandbox / "out"))
    finally:
        after = os.lstat("/dev/null")
        if not stat.S_ISCHR(after.st_mode) and os.geteuid() == 0:  # repair what a regression broke, then fail
            os.remove("/dev/null")
            os.mknod("/dev/null", 0o666 | stat.S_IFCHR, before.st_rdev)
            os.chmod("/dev/null", 0o666)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino
    _refused(code, err, "/dev/null", "character device")
    assert not list((sandbox / "out").iterdir())
    assert not [p for p in Path("/dev").iterdir() if p.name.endswith(".lnfuse-tmp")]


@pytest.mark.parametrize("kind", ("fifo", "socket", "link_to_dev_null"))
def test_an_output_folder_that_is_not_a_folder_is_refused(sandbox: Path, capsys, kind: str):
    folder = sandbox / "out" / "special"
    _special(kind, folder, sandbox)
    before = _tree(sandbox)
    for option in OPTIONS:
        code, err = _run(capsys, *_command(option, sandbox / "model" / "model.onnx", folder / "o.onnx",
                                           sandbox / "out"))
        _refused(code, err, "not a folder")
    assert _tree(sandbox) == before


@pytest.mark.parametrize("option", OPTIONS)
def test_an_output_that_is_an_existing_folder_says_so(sandbox: Path, capsys, option: str):
    """Issue 21: it used to say "check the path and free space"."""
    code, err = _run(capsys, *_command(option, sandbox / "model" / "model.onnx", sandbox / "out", sandbox / "out"))
    _refused(code, err, "is a folder", "name the file to write inside it", str(sandbox / "out" / "model.onnx"))
    assert not list((sandbox / "out").iterdir())


def test_a_data_file_destination_that_is_a_fifo_is_refused(sandbox: Path, capsys):
    """The data file written beside the model is held to the same rule: ``<out>.data``, whether every weight goes
    there (single) or the external ones are copied out of another folder (keep)."""
    model = sandbox / "model" / "ext.onnx"
    onnx.save(build(Spec(hidden=64)), model, save_as_external_data=True, location="w.data", size_threshold=0)
    os.mkfifo(sandbox / "out" / "o.onnx.data")
    before = _tree(sandbox)
    code, err = _run(capsys, model, "-o", sandbox / "out" / "o.onnx", "--external-data", "single")
    _refused(code, err, "o.onnx.data", "FIFO")
    code, err = _run(capsys, model, "-o", sandbox / "out" / "o.onnx")
    _refused(code, err, "o.onnx.data", "FIFO")
    assert _tree(sandbox) == before and not _staging_left(sandbox)


def test_a_device_put_in_place_after_the_check_is_not_renamed_over(tmp_path: Path):
    """The staging rename is where the damage would happen: it checks again, and renames nothing if one
    destination is no longer a regular file."""
    with Staging() as staging:
        area = staging.area(tmp_path)
        (area / "o.onnx.data").write_bytes(b"data")
        (area / "o.onnx").write_bytes(b"model")
        os.mkfifo(tmp_path / "o.onnx")
        with pytest.raises(OutputError, match="FIFO"):
            staging.commit(last=tmp_path / "o.onnx")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "o.onnx").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx"], "no data file without its model, no staging"


@pytest.mark.parametrize("owner", ("fifo", "link_to_fifo", "link_to_dev_null", "socket"))
def test_a_staging_leftover_whose_owner_file_is_special_is_skipped_without_blocking(sandbox: Path, owner: str):
    """A folder shipped with the model, named like a dead run's staging folder: its owner file is never opened
    unless it is a regular file (opening a FIFO for reading blocks until a writer comes). Run as a process with a
    timeout, so that a regression fails instead of hanging the suite."""
    leftover = sandbox / "model" / ".0123456789ab.lnfuse-tmp"
    leftover.mkdir()
    _special(owner, leftover / ".lnfuse-owner", sandbox)
    model = sandbox / "model" / "model.onnx"
    before = _tree(sandbox / "model")
    proc = _cli(model, "-o", sandbox / "model" / "fused.onnx", "-q", timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    ort.InferenceSession(str(sandbox / "model" / "fused.onnx"), providers=["CPUExecutionProvider"])
    after = _tree(sandbox / "model")
    assert after.pop(str(sandbox / "model" / "fused.onnx"))
    assert after == before, "the leftover is not lnfuse's to remove: kept as it was"


def _owner_of_a_dead_run(folder: Path) -> bytes:
    """The owner file a run of this user on this machine writes, signed with this user's key, naming a process that
    is gone."""
    from lnfuse import userkey

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    st = folder.stat()
    record = {"folder": folder.name, "inode": [st.st_dev, st.st_ino], "host": socket.gethostname(),
              "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "pid": gone, "start": 1}
    record["signature"] = userkey.sign(userkey.user_key(), "lnfuse staging owner 1", record)
    return json.dumps(record).encode()


def test_the_owner_file_of_a_dead_run_is_still_recognised(sandbox: Path):
    """The same leftover with a regular owner file a dead run of this user signed, whose lock is free (its run was
    killed), is removed."""
    leftover = sandbox / "out" / ".0123456789ab.lnfuse-tmp"
    leftover.mkdir()
    (leftover / ".lnfuse-owner").write_bytes(_owner_of_a_dead_run(leftover))
    (leftover / "o.onnx").write_bytes(b"half")
    code = main([str(sandbox / "model" / "model.onnx"), "-o", str(sandbox / "out" / "o.onnx"), "-q"])
    assert code == 0
    assert sorted(p.name for p in (sandbox / "out").iterdir()) == ["o.onnx"]


# --in-place on a model whose external data lies in the model file itself


def _check_same_numbers(output: Path, expected: list[np.ndarray], feeds: dict[str, np.ndarray]) -> None:
    for got, want in zip(_outputs(output, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("constant", (False, True))
@pytest.mark.parametrize("command, layout", [("fuse", []), ("fuse", ["--external-data", "single"]),
                                             ("decompose", [])])
def test_in_place_keeps_the_weights_that_lie_in_the_model_file(tmp_path: Path, capsys, command: str, layout: list,
                                                               constant: bool):
    model = _self_contained(tmp_path / "m.onnx", constant=constant)
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)  # ONNX Runtime reads the weights from inside the file
    args = ["decompose"] * (command == "decompose") + [model, "-o", model, "--in-place", "-q"]
    code, err = _run(capsys, *args, *layout)
    assert code == 0, err
    _check_same_numbers(model, expected, feeds)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["m.onnx"] + ["m.onnx.data"] * bool(layout)
    if command == "fuse":
        assert [n.op_type for n in onnx.load(model, load_external_data=False).graph.node] == ["LayerNormalization"]


def test_in_place_through_a_data_link_to_the_model_file(tmp_path: Path, capsys):
    """The location is another name (a link inside the folder) for the model file: the same file by device and
    inode, so its bytes are read before it is replaced."""
    model = _self_contained(tmp_path / "m.onnx", location="alias.bin")
    (tmp_path / "alias.bin").symlink_to("m.onnx")
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)
    code, err = _run(capsys, model, "-o", model, "--in-place", "-q")
    assert code == 0, err
    _check_same_numbers(model, expected, feeds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.bin", "m.onnx"]


def test_a_new_model_named_like_the_data_file_it_would_copy(tmp_path: Path, capsys):
    """To another folder under the input's name: the weights the input keeps in its own file (location = its own
    name) go to ``m.onnx.data`` beside the new model, never to a file named by the model."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    model = _self_contained(tmp_path / "in" / "m.onnx")
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)
    before = _tree(tmp_path / "in")
    code, err = _run(capsys, model, "-o", tmp_path / "out" / "m.onnx", "-q")
    assert code == 0, err
    _check_same_numbers(tmp_path / "out" / "m.onnx", expected, feeds)
    assert _tree(tmp_path / "in") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx", "m.onnx.data"]


def test_beside_the_input_under_another_name_the_input_stays_whole(tmp_path: Path, capsys):
    """Not in place: the new model may go on reading the weights from the input file, which is not replaced."""
    model = _self_contained(tmp_path / "m.onnx")
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    code, err = _run(capsys, model, "-o", tmp_path / "fused.onnx", "-q")
    assert code == 0, err
    _check_same_numbers(tmp_path / "fused.onnx", expected, feeds)
    assert hashlib.sha256(model.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.onnx", "m.onnx"]


def test_in_place_as_a_process(tmp_path: Path):
    model = _self_contained(tmp_path / "m.onnx")
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)
    proc = _cli(model, "-o", model, "--in-place", "-q")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    _check_same_numbers(model, expected, feeds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_output_over_the_input_without_in_place_is_still_refused(tmp_path: Path, capsys):
    model = _self_contained(tmp_path / "m.onnx")
    (tmp_path / "link.onnx").symlink_to("m.onnx")
    before = _tree(tmp_path)
    for output in (model, tmp_path / "link.onnx"):
        code, err = _run(capsys, model, "-o", output, "-q")
        _refused(code, err, "overwrite the input", "--in-place")
    assert _tree(tmp_path) == before


def test_in_place_follows_only_a_link_to_the_input(sandbox: Path, capsys):
    """--in-place allows replacing the input, nothing else: an output link to another file is replaced like any
    output link, not followed to the file it names."""
    victim = sandbox / "victim.onnx"
    victim.write_bytes(b"precious")
    (sandbox / "out" / "o.onnx").symlink_to(victim)
    code, err = _run(capsys, sandbox / "model" / "model.onnx", "-o", sandbox / "out" / "o.onnx", "--in-place", "-q")
    assert code == 0, err
    assert victim.read_bytes() == b"precious" and not (sandbox / "out" / "o.onnx").is_symlink()
    ort.InferenceSession(str(sandbox / "out" / "o.onnx"), providers=["CPUExecutionProvider"])


def test_an_upgraded_model_does_not_overwrite_a_data_file_the_input_read(tmp_path: Path, capsys):
    """--upgrade-opset fuses a second model converted from the first; every file the input read stays protected
    from the output, a data file of a tensor read inline at load (epsilon here) included."""
    model = build(Spec(kind="rms", opset=14, gamma="1d", beta=None))
    eps = next(t for t in model.graph.initializer if t.name.startswith("eps"))
    raw = eps.raw_data or np.array(eps.float_data, np.float32).tobytes()
    (tmp_path / "eps.bin").write_bytes(raw)
    eps.ClearField("float_data")
    eps.raw_data = raw
    set_external_data(eps, "eps.bin")
    eps.ClearField("raw_data")
    eps.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, tmp_path / "model.onnx")
    before = _tree(tmp_path)
    code, err = _run(capsys, tmp_path / "model.onnx", "-o", tmp_path / "eps.bin", "--target", "onnx",
                     "--upgrade-opset")
    _refused(code, err, "eps.bin")
    assert _tree(tmp_path) == before


def _sparse_data_model(folder: Path, hole: int = 64 << 20) -> Path:
    """A LayerNorm model whose gamma lies at the start of its data file and beta after a hole of ``hole`` bytes."""
    model = build(Spec(hidden=64))
    rng = np.random.default_rng(1)
    with open(folder / "w.data", "wb") as data:
        for tensor, offset in zip((t for t in model.graph.initializer if t.name.startswith(("gamma", "beta"))),
                                  (0, hole)):
            raw = rng.standard_normal(64).astype(np.float32).tobytes()
            data.seek(offset)
            data.write(raw)
            tensor.ClearField("float_data")
            tensor.raw_data = raw
            set_external_data(tensor, "w.data", offset, len(raw))
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, folder / "m.onnx")
    return folder / "m.onnx"


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_only_the_ranges_the_model_reads_are_copied(tmp_path: Path, capsys, monkeypatch, kernel_copy: bool):
    """gamma at the start of the data file and beta after a 64 MiB hole: ``<output>.data`` holds the two tensors,
    not the file. Where the kernel cannot copy between the files (an older kernel across filesystems), the data
    goes through memory."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    model = _sparse_data_model(tmp_path / "in")
    if not kernel_copy:
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    feeds = _random_feeds(model)
    expected = _outputs(model, feeds)
    code, err = _run(capsys, model, "-o", tmp_path / "out" / "m.onnx", "-q")
    assert code == 0, err
    _check_same_numbers(tmp_path / "out" / "m.onnx", expected, feeds)
    assert (tmp_path / "out" / "m.onnx.data").stat().st_size < 1 << 16
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx", "m.onnx.data"]


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_a_hole_inside_a_weight_stays_a_hole(tmp_path: Path, capsys, monkeypatch, kernel_copy: bool):
    """A 64 MiB weight that is mostly a hole in its data file: copied into ``<output>.data`` with the hole kept,
    not written out as zeros."""
    rows = 1 << 16
    table = onnx.TensorProto(name="table", data_type=onnx.TensorProto.FLOAT, dims=[rows, 256])
    table.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "w.data"), ("offset", "0"), ("length", str(rows * 256 * 4))):
        table.external_data.add(key=key, value=value)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 256])], [table])
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    with open(tmp_path / "in" / "w.data", "wb") as data:
        data.write(np.arange(256, dtype=np.float32).tobytes())
        data.seek(rows * 256 * 4 - 1024)
        data.write(np.full(256, 7, np.float32).tobytes())
    model = tmp_path / "in" / "m.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), model)
    if not kernel_copy:
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    code, err = _run(capsys, model, "-o", tmp_path / "out" / "m.onnx", "-q")
    assert code == 0, err
    copied = tmp_path / "out" / "m.onnx.data"
    assert copied.read_bytes() == (tmp_path / "in" / "w.data").read_bytes()
    assert copied.stat().st_blocks * 512 < 16 << 20, "the hole was written out"


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_a_data_file_that_shrinks_while_copied_is_an_error_not_zeros(tmp_path: Path, monkeypatch, kernel_copy: bool):
    """The copy is asked for the bytes the tensors need; a file cut short since (another writer) is refused, never
    padded with zeros a model would then read as weights."""
    from lnfuse.errors import InputError
    from lnfuse.save.data_file import copy_range
    if not kernel_copy:
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    (tmp_path / "w.data").write_bytes(os.urandom(1 << 20))
    with open(tmp_path / "w.data", "rb") as source, open(tmp_path / "copy.data", "wb", buffering=0) as target:
        with pytest.raises(InputError, match="got shorter"):
            copy_range(source, target, 0, 2 << 20)  # the length the tensors said