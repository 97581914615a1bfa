"""What a model names is never a path lnfuse writes. Each attack of the red team's on the write side, rebuilt from a
real norm model: the weights "live" in ``.git/config`` or ``.bashrc``, are reached through many links to one file,
or overlap; the output goes into a folder that holds the user's files. After every run the user's files are
byte-identical, the output computes what the input computes, and what lnfuse wrote is the output and
``<output>.data``: nothing else, and never more bytes than the model reads."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgraphs import Spec, build

USER_FILES = {".git/config": b"[core]\n\trepositoryformatversion = 0\n", ".bashrc": b"export PATH=$PATH\n",
              "notes.txt": b"the user's own\n", "b.onnx.json": b"{\"report\": \"of another model\"}\n"}


def _lnfuse(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _user_folder(folder: Path) -> dict[str, str]:
    for name, data in USER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return _hashes(folder)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _weights_at(folder: Path, locations: list[str], data_name: str, name: str = "model.onnx") -> Path:
    """A LayerNorm model whose gamma and beta are external data at ``locations`` (one each, cycled), all naming
    the one file ``folder/data_name`` (the caller links the others to it)."""
    model = build(Spec(hidden=64))
    (folder / data_name).parent.mkdir(parents=True, exist_ok=True)
    blob = bytearray()
    weights = [t for t in model.graph.initializer if t.name.startswith(("gamma", "beta"))]
    for i, tensor in enumerate(weights):
        raw = onnx.numpy_helper.to_array(tensor).tobytes()
        offset = len(blob)
        blob += raw
        tensor.ClearField("raw_data")
        tensor.ClearField("float_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", locations[i % len(locations)]), ("offset", str(offset)),
                           ("length", str(len(raw)))):
            tensor.external_data.add(key=key, value=value)
    (folder / data_name).write_bytes(bytes(blob))
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _outputs(path: Path) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 2 for d in i.shape])
            .astype(np.float32) for i in session.get_inputs()}
    return session.run(None, feed)


def _same_numbers(fused: Path, original: Path) -> None:
    for a, b in zip(_outputs(fused), _outputs(original)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("location", [".git/config", ".bashrc", "notes.txt", "b.onnx.json"])
@pytest.mark.parametrize("command", ["fuse", "decompose", "annotate"])
def test_a_data_file_named_like_a_users_file_never_replaces_it(tmp_path: Path, location: str, command: str):
    """The weights live at ``.git/config`` (whose ``core.fsmonitor`` git would run) or ``.bashrc`` in the model's
    folder; the output goes into the user's folder holding files of those names."""
    model_dir, out = tmp_path / "download", tmp_path / "repo"
    model_dir.mkdir()
    out.mkdir()
    model = _weights_at(model_dir, [location], location)
    before, download = _user_folder(out), _hashes(model_dir)
    args = {"fuse": [model, "-o", out / "fused.onnx"],
            "decompose": ["decompose", model, "-o", out / "fused.onnx"],
            "annotate": ["explain", model, "--annotate", out / "fused.onnx"]}[command]
    proc = _lnfuse(*args)
    assert proc.returncode == 0, proc.stderr
    assert _hashes(out) == before | {k: v for k, v in _hashes(out).items() if k.startswith("fused.onnx")}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("fused")) == ["fused.onnx", "fused.onnx.data"]
    assert _hashes(model_dir) == download, "the input never loses a byte"
    _same_numbers(out / "fused.onnx", model)


def test_an_output_in_the_home_folder_with_weights_named_bashrc(tmp_path: Path):
    """``-o ~/fused.onnx`` with the weights at ``.bashrc``: the home's ``.bashrc`` stays the user's."""
    home, model_dir = tmp_path / "home", tmp_path / "download"
    home.mkdir()
    model_dir.mkdir()
    (home / ".bashrc").write_bytes(USER_FILES[".bashrc"])
    model = _weights_at(model_dir, [".bashrc"], ".bashrc")
    proc = _lnfuse(model, "-o", home / "fused.onnx")
    assert proc.returncode == 0, proc.stderr
    assert (home / ".bashrc").read_bytes() == USER_FILES[".bashrc"]
    _same_numbers(home / "fused.onnx", model)


def test_a_many_model_run_into_a_folder_of_the_users(tmp_path: Path):
    """Models whose data files are named ``.bashrc``, like another model's report, or like the other model's
    output: each output's weights go to its own ``<output>.data``; the user's files and the reports stand."""
    zoo, out = tmp_path / "zoo", tmp_path / "out"
    zoo.mkdir()
    out.mkdir()
    a = _weights_at(zoo, [".bashrc"], ".bashrc", "a.onnx")
    _weights_at(zoo, ["b.onnx.json"], "b.onnx.json", "b.onnx")
    _weights_at(zoo, ["a.onnx.data"], "a.onnx.data", "c.onnx")  # named as a's output data file will be
    before = _user_folder(out)
    proc = _lnfuse(zoo, "-o", out, "--report", out, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    after = _hashes(out)
    del before["b.onnx.json"]  # b's report, which the user asked for in this folder
    assert {k: after[k] for k in before} == before, "the user's files are unchanged"
    assert json.loads((out / "b.onnx.json").read_text()).get("fused_counts"), "b's report is b's report"
    for name in ("a.onnx", "b.onnx", "c.onnx"):
        assert (out / (name + ".data")).is_file(), name
    _same_numbers(out / "a.onnx", a)
    _same_numbers(out / "c.onnx", zoo / "c.onnx")


def test_links_to_one_file_are_copied_once(tmp_path: Path):
    """``a0 -> .``, ``a1 -> .``, ...: every weight names the one data file through another chain of links. The
    output's data file holds each range once: no more bytes than the data file itself."""
    model_dir, out = tmp_path / "download", tmp_path / "out"
    model_dir.mkdir()
    out.mkdir()
    for i in range(8):
        (model_dir / f"a{i}").symlink_to(".", target_is_directory=True)
    locations = ["/".join(f"a{j}" for j in range(i % 8, 8)) + "/w.data" for i in range(16)]
    model = _weights_at(model_dir, locations, "w.data")
    proc = _lnfuse(model, "-o", out / "fused.onnx")
    assert proc.returncode == 0, proc.stderr
    assert (out / "fused.onnx.data").stat().st_size <= (model_dir / "w.data").stat().st_size
    assert sorted(p.name for p in out.iterdir()) == ["fused.onnx", "fused.onnx.data"]
    _same_numbers(out / "fused.onnx", model)


def test_overlapping_ranges_are_written_once(tmp_path: Path):
    """Many tensors reading overlapping ranges of one small file (a zip bomb's trick): the bytes written are the
    union of the ranges, never the sum of the tensors."""
    model_dir, out = tmp_path / "download", tmp_path / "out"
    model_dir.mkdir()
    out.mkdir()
    size, count = 1 << 16, 200
    (model_dir / "w.data").write_bytes(np.random.default_rng(0).standard_normal(size // 4 + count)
                                       .astype(np.float32).tobytes())
    inputs = []
    for i in range(count):
        tensor = onnx.TensorProto(name=f"w{i}", data_type=onnx.TensorProto.FLOAT, dims=[size // 4],
                                  data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", "w.data"), ("offset", str(4 * i)), ("length", str(size))):
            tensor.external_data.add(key=key, value=value)
        inputs.append(tensor)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Sum", ["x"] + [t.name for t in inputs], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [size // 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [size // 4])], inputs)
    model = model_dir / "model.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), model)
    proc = _lnfuse(model, "-o", out / "fused.onnx")
    assert proc.returncode == 0, proc.stderr
    assert (out / "fused.onnx.data").stat().st_size <= (model_dir / "w.data").stat().st_size + 4096
    _same_numbers(out / "fused.onnx", model)


def test_beside_the_model_the_data_files_are_referenced_not_written(tmp_path: Path):
    """An output in the model's own folder reads the weights where they are: nothing but the model is written."""
    model = _weights_at(tmp_path, ["w.data"], "w.data")
    before = _hashes(tmp_path)
    proc = _lnfuse(model, "-o", tmp_path / "fused.onnx")
    assert proc.returncode == 0, proc.stderr
    assert set(_hashes(tmp_path)) - set(before) == {"fused.onnx"} and \
        {k: v for k, v in _hashes(tmp_path).items() if k in before} == before
    _same_numbers(tmp_path / "fused.onnx", model)


def test_a_constant_with_external_data_and_a_single_data_file(tmp_path: Path):
    """A main-graph Constant holding a weight as external data, written with ``--external-data single``: the
    output names its own data file, and ONNX Runtime loads it from another folder."""
    model_dir, out = tmp_path / "download", tmp_path / "out"
    model_dir.mkdir()
    out.mkdir()
    values = np.random.default_rng(1).standard_normal(2048).astype(np.float32)
    (model_dir / "c.data").write_bytes(values.tobytes())
    tensor = onnx.TensorProto(name="c", data_type=onnx.TensorProto.FLOAT, dims=[2048],
                              data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", "c.data"), ("offset", "0"), ("length", str(values.nbytes))):
        tensor.external_data.add(key=key, value=value)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["c"], value=tensor), onnx.helper.make_node("Add", ["x", "c"], ["y"])],
        "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2048])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2048])])
    model = model_dir / "model.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), model)
    for layout in ("single", "keep"):
        proc = _lnfuse(model, "-o", out / f"{layout}.onnx", "--external-data", layout)
        assert proc.returncode == 0, proc.stderr
        _same_numbers(out / f"{layout}.onnx", model)
        onnx.checker.check_model(str(out / f"{layout}.onnx"), full_check=True)
