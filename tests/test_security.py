"""One test per attack on the trust boundary: a hostile model folder must not make lnfuse read a file outside it,
write outside the output folder, or destroy its input. Each crafted folder is built here from a real model."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx.external_data_helper import set_external_data

import lnfuse
from lnfuse.cli import main
from lnfuse.save.staging import Staging
from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- not for the output " * 5


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _run(capsys, *args) -> tuple[int, str]:
    """main() in this process: the same code path and exit code as the command (the subprocess tests show it)."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` with what it is: a link's target, a file's hash (a snapshot to compare)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = "dir"
    return found


def _external_model(folder: Path, location: str = "w.data", **entries: str) -> Path:
    """A LayerNorm model whose gamma (64 floats) is external data at ``location`` (the file is written at
    folder/w.data); ``entries`` override the offset and length as written in the model."""
    model = build(Spec(hidden=64))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    raw = onnx.numpy_helper.to_array(gamma).tobytes()
    (folder / "w.data").write_bytes(raw)
    set_external_data(gamma, location, 0, len(raw))
    gamma.ClearField("raw_data")
    gamma.ClearField("float_data")
    gamma.data_location = onnx.TensorProto.EXTERNAL
    for key, value in entries.items():
        next(e for e in gamma.external_data if e.key == key).value = value
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def sandbox(tmp_path: Path):
    """model/ (the untrusted folder), out/ (the output folder) and outside/ holding a secret."""
    for name in ("model", "out", "outside"):
        (tmp_path / name).mkdir()
    (tmp_path / "outside" / "id_rsa").write_bytes(SECRET)
    return tmp_path


def _refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("lnfuse: error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and all(w in err for w in words), err


def _escape_cases(root: Path) -> dict[str, str]:
    """Location written in the model -> how the model folder is prepared for it."""
    model, outside = root / "model", root / "outside"
    deep = outside
    for level in range(30):
        deep = deep / f"d{level}"
    deep.mkdir(parents=True)
    (model / "deep").symlink_to(deep, target_is_directory=True)
    (model / "sub").symlink_to(outside, target_is_directory=True)
    (model / "key.data").symlink_to(outside / "id_rsa")
    return {"dotdot": "../outside/id_rsa", "absolute": str(outside / "id_rsa"), "etc": "/etc/passwd",
            "deep_symlink": "deep/" + "../" * 30 + "id_rsa", "symlinked_folder": "sub/id_rsa",
            "symlinked_file": "key.data", "nul": "w.data\0../../x"}


@pytest.mark.parametrize("case", ["dotdot", "absolute", "etc", "deep_symlink", "symlinked_folder",
                                  "symlinked_file", "nul"])
def test_external_data_outside_the_model_folder_is_refused(sandbox: Path, capsys, case: str):
    location = _escape_cases(sandbox)[case]
    path = _external_model(sandbox / "model", location, length=str(len(SECRET)))
    before = _tree(sandbox)
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx")
    _refused(code, err, "gamma")
    assert _tree(sandbox) == before, "nothing was written anywhere"


def test_the_original_escape_writes_nothing_outside(sandbox: Path):
    """The critical case of the issue, end to end as a user runs it: '../../x' with --external-data keep and the
    output in another folder used to drop the payload two folders above the temporary output folder."""
    deep_out = sandbox / "out" / "a" / "b"
    deep_out.mkdir(parents=True)
    path = _external_model(sandbox / "model", "../../payload")
    (sandbox / "payload").write_bytes((sandbox / "model" / "w.data").read_bytes())
    before = _tree(sandbox)
    proc = _cli(path, "-o", deep_out / "o.onnx")
    _refused(proc.returncode, proc.stderr, "gamma", "outside the model's folder")
    assert _tree(sandbox) == before


def test_hard_linked_data_file_is_refused(sandbox: Path, capsys):
    path = _external_model(sandbox / "model")
    os.link(sandbox / "model" / "w.data", sandbox / "outside" / "other-name")
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx")
    _refused(code, err, "gamma", "hard links")
    assert not list((sandbox / "out").iterdir())


@pytest.mark.parametrize("entries, words", [
    ({"offset": "-4"}, "offset"), ({"offset": "1e3"}, "offset"), ({"length": "abc"}, "length"),
    ({"length": "-256"}, "length"), ({"offset": "1"}, "past the end"), ({"length": "255"}, "not the 256 bytes"),
    ({"offset": str(1 << 62)}, "past the end"), ({"length": str(1 << 40)}, "not the 256 bytes")])
def test_bad_offsets_and_lengths_are_refused(sandbox: Path, capsys, entries: dict, words: str):
    path = _external_model(sandbox / "model", **entries)
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx")
    _refused(code, err, "gamma", words)
    assert not list((sandbox / "out").iterdir())


def test_the_api_paths_keep_the_boundary(sandbox: Path, monkeypatch):
    """A ModelProto (read relative to the working directory) and an onnx_ir model (read from its tensors' folder)
    are held to the same boundary as a file."""
    path = _external_model(sandbox / "model", "../outside/id_rsa", length=str(len(SECRET)))
    monkeypatch.chdir(sandbox / "model")
    with pytest.raises(lnfuse.InputError, match="outside the model's folder"):
        lnfuse.fuse(onnx.load(path, load_external_data=False))
    (sandbox / "model" / "key.data").symlink_to(sandbox / "outside" / "id_rsa")
    path = _external_model(sandbox / "model", "key.data", length=str(len(SECRET)))
    with pytest.raises(lnfuse.InputError, match="a link to"):
        lnfuse.fuse(ir.load(path))


def test_legitimate_external_data_still_works(sandbox: Path, capsys):
    """Same folder, a plain subfolder, and a subfolder that is a link inside the model folder."""
    model = sandbox / "model"
    (model / "weights").mkdir()
    (model / "alias").symlink_to(model / "weights", target_is_directory=True)
    for location in ("w.data", "weights/w.data", "alias/w.data"):
        path = _external_model(model, location)
        if location != "w.data":
            os.replace(model / "w.data", model / "weights" / "w.data")
        out = sandbox / "out" / location.replace("/", "_") / "o.onnx"
        out.parent.mkdir()
        code, err = _run(capsys, path, "-o", out)
        assert code == 0, err
        onnx.checker.check_model(str(out), full_check=True)


def test_report_over_the_input_is_refused(sandbox: Path, capsys):
    path = _external_model(sandbox / "model")
    before = _tree(sandbox)
    for report in (path, sandbox / "model" / "w.data"):
        code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx", "--report", report)
        _refused(code, err, "input")
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx", "--report", sandbox / "out" / "o.onnx")
    _refused(code, err, "twice")
    assert _tree(sandbox) == before


def test_output_over_the_input_data_file_is_refused(sandbox: Path, capsys):
    path = _external_model(sandbox / "model")
    os.link(path, sandbox / "out" / "hardlink.onnx")
    before = _tree(sandbox)
    for output in (sandbox / "model" / "w.data", sandbox / "out" / "hardlink.onnx"):
        for in_place in ([], ["--in-place"]):
            code, err = _run(capsys, path, "-o", output, *in_place)
            if output.name == "hardlink.onnx" and in_place:
                continue  # the input by another name: --in-place asked for exactly that
            _refused(code, err, "input")
            assert _tree(sandbox) == before


def test_single_data_file_over_the_input_data_is_refused(sandbox: Path, capsys):
    path = _external_model(sandbox / "model", "o.onnx.data")
    os.replace(sandbox / "model" / "w.data", sandbox / "model" / "o.onnx.data")
    before = _tree(sandbox)
    code, err = _run(capsys, path, "-o", sandbox / "model" / "o.onnx", "--external-data", "single")
    _refused(code, err, "o.onnx.data", "input")
    assert _tree(sandbox) == before


def test_a_report_that_cannot_be_written_leaves_no_model(sandbox: Path):
    path = _external_model(sandbox / "model")
    # /sys refuses new files even for root (the tests may run as root, for whom permissions are no obstacle)
    proc = _cli(path, "-o", sandbox / "out" / "o.onnx", "--report", "/sys/lnfuse-report.json")
    _refused(proc.returncode, proc.stderr)
    assert not list((sandbox / "out").iterdir()), "no model without its report"


def test_keep_layout_never_writes_where_the_model_names(sandbox: Path, capsys):
    """The model's data file lives in ``weights/w.data``, and the output folder holds a link ``weights`` out of it:
    the weights go to ``o.onnx.data``, named from the output, and nothing is written through the link."""
    model = sandbox / "model"
    (model / "weights").mkdir()
    path = _external_model(model, "weights/w.data")
    os.replace(model / "w.data", model / "weights" / "w.data")
    (sandbox / "out" / "weights").symlink_to(sandbox / "outside", target_is_directory=True)
    before = _tree(sandbox / "outside")
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx")
    assert code == 0, err
    assert _tree(sandbox / "outside") == before
    assert sorted(p.name for p in (sandbox / "out").iterdir()) == ["o.onnx", "o.onnx.data", "weights"]


def test_an_output_that_is_a_link_is_replaced_not_followed(sandbox: Path, capsys):
    victim = sandbox / "outside" / "victim.onnx"
    victim.write_bytes(b"precious")
    (sandbox / "out" / "o.onnx").symlink_to(victim)
    path = _external_model(sandbox / "model")
    code, err = _run(capsys, path, "-o", sandbox / "out" / "o.onnx")
    assert code == 0, err
    assert victim.read_bytes() == b"precious" and not (sandbox / "out" / "o.onnx").is_symlink()


def test_in_place_through_a_link_rewrites_its_target_and_keeps_the_link(tmp_path: Path, capsys):
    real = tmp_path / "real.onnx"
    onnx.save(build(Spec(opset=17)), real)
    link = tmp_path / "link.onnx"
    link.symlink_to(real.name)
    code, err = _run(capsys, link, "-o", link, "--in-place")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == real.name
    assert [n.op_type for n in onnx.load(real).graph.node] == ["LayerNormalization"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.onnx", "real.onnx"]


def test_a_255_character_output_name_works(tmp_path: Path, capsys):
    out = tmp_path / ("o" * 250 + ".onnx")
    code, err = _run(capsys, SAMPLES / "llama_tiny_legacy_op14.onnx", "-o", out, "-q")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_newline_in_a_path_stays_on_one_line(tmp_path: Path):
    folder = tmp_path / "two\nlines"
    folder.mkdir()
    proc = _cli(folder / "missing\x1b[2J.onnx", "-o", tmp_path / "o.onnx")
    _refused(proc.returncode, proc.stderr, "\\n", "\\x1b")
    path = _external_model(folder, "w\n.data")
    proc = _cli(path, "-o", tmp_path / "o.onnx")
    _refused(proc.returncode, proc.stderr, "missing")


def test_a_file_of_0xff_bytes_is_refused(tmp_path: Path, capsys):
    """The wire walker's varint loop is bounded (the time is in docs/security.md, not asserted here)."""
    path = tmp_path / "ff.onnx"
    path.write_bytes(b"\xff" * (1 << 20))
    code, err = _run(capsys, path, "-o", tmp_path / "o.onnx")
    _refused(code, err, "not a readable ONNX model")


_DYING_RUN = """
import sys, time
from pathlib import Path
from lnfuse.save.staging import Staging
area = Staging().area(Path(sys.argv[1]))
(area / "o.onnx.data").write_bytes(bytes(1 << 20))
print(area, flush=True)
time.sleep(300)
"""


def test_leftovers_of_a_killed_run_are_removed_and_nothing_else(sandbox: Path):
    out = sandbox / "out"
    # a run killed (SIGKILL: no cleanup runs) while its files were being written
    proc = subprocess.Popen([sys.executable, "-c", _DYING_RUN, str(out)], stdout=subprocess.PIPE, text=True)
    stale = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert stale.is_dir() and stale.parent == out
    not_ours = out / ".0123456789ab.lnfuse-tmp"  # named like lnfuse's but without its owner file
    not_ours.mkdir()
    with Staging() as live:  # a run still writing: its lock is held
        running = live.area(out)
        (running / "partial").write_bytes(b"x")
        code = main([str(_external_model(sandbox / "model")), "-o", str(out / "small.onnx"), "-q"])
        assert code == 0
        assert not stale.exists(), "the killed run's folder is removed"
        assert not_ours.exists() and (running / "partial").exists(), "what is not provably dead is kept"
    assert sorted(p.name for p in out.iterdir()) == sorted(["small.onnx", "small.onnx.data", not_ours.name])


def test_sparse_initializer_with_a_huge_dense_shape_is_refused(tmp_path: Path, capsys):
    model = build(Spec(hidden=64))
    values = onnx.numpy_helper.from_array(np.ones(4, np.float32), "huge")
    indices = onnx.numpy_helper.from_array(np.arange(4, dtype=np.int64), "")
    model.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [100_000, 100_000]))
    path = tmp_path / "sparse.onnx"
    path.write_bytes(model.SerializeToString())
    assert path.stat().st_size < 4096
    code, err = _run(capsys, path, "-o", tmp_path / "o.onnx")
    _refused(code, err, "huge")


def _malformed(flaw: str) -> bytes:
    """A real norm model with one flaw of a class that used to end in an internal error (exit 3)."""
    model = build(Spec(hidden=64))
    graph = model.graph
    gamma = next(t for t in graph.initializer if t.name.startswith("gamma"))
    if flaw == "no_outputs":
        graph.ClearField("output")
    elif flaw == "unknown_dtype":
        graph.value_info.append(onnx.helper.make_tensor_value_info(graph.node[0].output[0], 999, None))
    elif flaw == "cast_to_999":
        graph.node.append(onnx.helper.make_node("Cast", [graph.output[0].name], ["c"], to=999))
        graph.output.append(onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, None))
    elif flaw in ("negative_dim", "huge_dim", "zero_dim"):
        gamma.dims[0] = {"negative_dim": -64, "huge_dim": 1 << 40, "zero_dim": 0}[flaw]
    elif flaw == "string_raw_data":
        gamma.data_type = onnx.TensorProto.STRING
    elif flaw == "declared_shape":  # ORT refuses an input whose shape is not its initializer's
        graph.input.append(onnx.helper.make_tensor_value_info(gamma.name, onnx.TensorProto.FLOAT, [7]))
    elif flaw.startswith("sparse"):
        values = onnx.numpy_helper.from_array(np.ones(2, np.float32), gamma.name)
        index = {"sparse_index": [0, 64], "sparse_count": [0, 1, 2], "sparse_negative": [-1, 3]}[flaw]
        sparse = onnx.helper.make_sparse_tensor(values, onnx.numpy_helper.from_array(np.array(index, np.int64), ""),
                                                [64])
        graph.ClearField("initializer")
        graph.initializer.extend(t for t in build(Spec(hidden=64)).graph.initializer if t.name != gamma.name)
        graph.sparse_initializer.append(sparse)
    data = model.SerializeToString()
    if flaw == "utf8_name":
        name = graph.node[1].output[0].encode()
        data = data.replace(name, b"\xff" + name[1:])
    return data


@pytest.mark.parametrize("flaw, words", [
    ("no_outputs", "no outputs"), ("unknown_dtype", "data type 999"), ("cast_to_999", "'to'"),
    ("negative_dim", "negative dimension"), ("huge_dim", "needs"), ("zero_dim", "needs"),
    ("string_raw_data", "STRING"), ("declared_shape", "declares"), ("utf8_name", "not UTF-8"),
    ("sparse_index", "outside its shape"), ("sparse_count", "do not match"), ("sparse_negative", "outside")])
def test_malformed_models_are_refused_with_one_line(tmp_path: Path, capsys, flaw: str, words: str):
    path = tmp_path / "model.onnx"
    path.write_bytes(_malformed(flaw))
    code, err = _run(capsys, path, "-o", tmp_path / "out.onnx")
    _refused(code, err, words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize("dtype, shape", [(onnx.TensorProto.FLOAT, [7]), (onnx.TensorProto.DOUBLE, [64])])
def test_a_value_info_that_misstates_an_initializer_is_ignored_as_ort_ignores_it(tmp_path: Path, capsys, dtype, shape):
    """ONNX Runtime reads an initializer as it is, whatever a value_info of its name says; lnfuse drops such a
    value_info at load, fuses, and the output computes what the input computes."""
    model = build(Spec(hidden=64))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(gamma.name, dtype, shape))
    path, out = tmp_path / "model.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    feeds = {i.name: np.random.default_rng(0).standard_normal(
        [d.dim_value or 2 for d in i.type.tensor_type.shape.dim]).astype(np.float32) for i in model.graph.input}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    code, err = _run(capsys, path, "-o", out, "--target", "onnx")
    assert code == 0, err
    onnx.checker.check_model(str(out), full_check=True)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3)
