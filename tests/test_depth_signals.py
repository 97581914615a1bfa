"""Issue 27, depth and signals: nothing a model or a folder decides sets how deep lnfuse recurses, and SIGTERM or
SIGHUP clean up as Ctrl-C does. Every case runs the real CLI on a real model or folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto
from onnx.external_data_helper import set_external_data

_CLI = [sys.executable, "-m", "lnfuse.cli"]


# ---------------------------------------------------------------------------------------------------------------
# SIGTERM and SIGHUP


def _big_model(folder: Path, name: str = "big") -> Path:
    """A model whose ``--external-data single`` output copies a 256 MiB data file of real bytes (a hole would be
    skipped in no time): long enough to write that a signal lands in the middle of the save."""
    folder.mkdir(parents=True, exist_ok=True)
    big = onnx.TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[_BIG >> 2], raw_data=b"\0")
    set_external_data(big, f"{name}.data", 0, _BIG)
    big.ClearField("raw_data")
    big.data_location = TensorProto.EXTERNAL
    graph = oh.make_graph([oh.make_node("Size", ["big"], ["n"])], "g", [],
                          [oh.make_tensor_value_info("n", TensorProto.INT64, [])], [big])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    chunk = b"\x01" * (1 << 24)
    with open(folder / f"{name}.data", "wb") as data:
        for _ in range(_BIG // len(chunk)):
            data.write(chunk)
    path = folder / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return path


_BIG = 1 << 28


def _staging(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".lnfuse-tmp")] if folder.exists() else []


def _signal_while_saving(args: list[str], out: Path, signum: int, group: bool = False) -> tuple[int, str]:
    """Start lnfuse, wait until its temporary folder appears under ``out`` (it is saving), send ``signum`` to it
    (or to its whole process group, as ``timeout`` and CI runners do) and return its exit code and stderr."""
    proc = subprocess.Popen(_CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not _staging(out):
        time.sleep(0.005)
    assert proc.poll() is None, "the write finished before it could be stopped"
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_write_leaves_nothing(tmp_path: Path, signum: int):
    src = _big_model(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    code, err = _signal_while_saving([str(src), "-o", str(out / "o.onnx"), "--external-data", "single", "-q"],
                                     out, signum)
    assert code == 128 + signum and f"interrupted ({signal.Signals(signum).name})" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(out.iterdir()) == [], "no output, no temporary folder, no partial data file"
    assert sorted(p.name for p in src.parent.iterdir()) == ["big.data", "big.onnx"]
    assert (src.parent / "big.data").stat().st_size == _BIG, "the input is untouched"


@pytest.mark.parametrize("signum,group", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)])
def test_a_signal_to_a_many_model_run_leaves_no_temporary_file(tmp_path: Path, signum: int, group: bool):
    models = tmp_path / "models"
    for name in ("a", "b"):
        _big_model(models, name)
    out = tmp_path / "out"
    code, err = _signal_while_saving([str(models), "-o", str(out), "--jobs", "2", "--external-data", "single"],
                                     out, signum, group)
    assert code == 128 + signum, err
    assert "rerun the same command" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert _staging(out) == [], "no temporary folder"
    assert not [p for p in out.iterdir() if p.name != "lnfuse-ledger.jsonl"], "no partial output or data file"
    assert all((models / f"{n}.data").stat().st_size == _BIG for n in "ab"), "the inputs are untouched"


# ---------------------------------------------------------------------------------------------------------------
# folders


def _nest(root: Path, depth: int, leaf: str | None = None) -> None:
    """``depth`` folders nested under ``root`` (paths far past PATH_MAX: made one level at a time through file
    descriptors), with an empty file ``leaf`` at the bottom."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    if leaf is not None:
        os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)


def _unnest(root: Path) -> None:
    """Remove what ``_nest`` made, bottom up without recursion (shutil.rmtree recurses once per level)."""
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY)]
    while "d" in os.listdir(fds[-1]):
        fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    while fds:
        fd = fds.pop()
        for name in os.listdir(fd):
            if name != "d":
                os.unlink(name, dir_fd=fd)
        if fds:
            os.rmdir("d", dir_fd=fds[-1])
        os.close(fd)


@pytest.fixture(scope="module")
def deep_tree():
    # in memory where there is a tmpfs: 10,000 nested folders take 15 s to make on a busy ext4, 0.5 s there
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(dir=shm, prefix="lnfuse-deep-"))
    (root / "top.onnx").write_bytes(b"")
    _nest(root, 10_000, "m.onnx")
    yield root
    _unnest(root)
    os.rmdir(root)


@pytest.mark.parametrize("how", ["folder", "glob"])
def test_a_folder_nested_10000_deep_is_refused_at_once(tmp_path: Path, deep_tree: Path, how: str):
    start = time.monotonic()
    given = str(deep_tree) if how == "folder" else f"{deep_tree}/**/*.onnx"
    proc = subprocess.run(_CLI + [given, "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nested more than 64 deep" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert time.monotonic() - start < 20, "refused before walking the whole tree"
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# nested bodies


def _nested_ifs(depth: int) -> onnx.ModelProto:
    """``depth`` Ifs, each in the then-branch of the one above, built in memory (protobuf refuses to copy a message
    nested past its limit, so each level is added in place)."""
    model = onnx.ModelProto(ir_version=8)
    model.opset_import.add(domain="", version=17)
    graph, out = model.graph, "y"
    graph.name = "g"
    graph.input.extend([oh.make_tensor_value_info("c", TensorProto.BOOL, []),
                        oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])])
    graph.output.append(oh.make_tensor_value_info(out, TensorProto.FLOAT, [2]))
    for k in range(depth):
        node = graph.node.add(op_type="If", input=["c"], output=[out], name=f"if{k}")
        other = node.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH)
        other.g.name = f"e{k}"
        other.g.node.append(oh.make_node("Neg", ["x"], [f"e{k}"]))
        other.g.output.append(oh.make_tensor_value_info(f"e{k}", TensorProto.FLOAT, [2]))
        then = node.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH)
        graph, out = then.g, f"t{k}"
        graph.name = out
        graph.output.append(oh.make_tensor_value_info(out, TensorProto.FLOAT, [2]))
    graph.node.append(oh.make_node("Identity", ["x"], [out]))
    return model


def test_bodies_nested_as_deep_as_a_file_holds_are_fused(tmp_path: Path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_nested_ifs(30).SerializeToString())
    proc = subprocess.run(_CLI + [str(path), "-o", str(tmp_path / "o.onnx"), "-q"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    import onnxruntime as ort
    ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"])


def test_bodies_nested_10000_deep_are_refused(tmp_path: Path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_nested_ifs(10_000).SerializeToString())
    proc = subprocess.run(_CLI + [str(path), "-o", str(tmp_path / "o.onnx")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "nested deeper than a model file can hold" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()


def _nested_ir(depth: int):
    """``depth`` Ifs, each in the then-branch of the one above, as an onnx_ir model."""
    import onnx_ir as ir

    c = ir.Value(name="c", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))

    def typed(node, name: str):
        node.outputs[0].name = name
        node.outputs[0].type, node.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([2])
        return node

    body = None
    for k in range(depth):
        inner = typed(ir.node("Identity", [x]), f"i{k}") if body is None else None
        if body is not None:
            other = typed(ir.node("Neg", [x]), f"e{k}")
            inner = typed(ir.node("If", [c], {"then_branch": body, "else_branch": ir.Graph(
                [], other.outputs, nodes=[other], name=f"eb{k}")}), f"t{k}")
        body = ir.Graph([], inner.outputs, nodes=[inner], name=f"b{k}")
    other = typed(ir.node("Neg", [x]), "e")
    top = typed(ir.node("If", [c], {"then_branch": body,
                                    "else_branch": ir.Graph([], other.outputs, nodes=[other], name="eb")}), "y")
    graph = ir.Graph([c, x], top.outputs, nodes=[top], name="g", opset_imports={"": 17})
    return ir.Model(graph, ir_version=8)


@pytest.mark.parametrize("kind", ["proto", "onnx_ir"])
def test_bodies_nested_10000_deep_in_memory_are_refused_by_the_api(kind: str):
    import lnfuse
    from lnfuse.errors import InputError

    model = _nested_ifs(10_000) if kind == "proto" else _nested_ir(10_000)
    with pytest.raises(InputError, match="nested deeper than a model file can hold"):
        lnfuse.fuse(model)


# ---------------------------------------------------------------------------------------------------------------
# value chains 10,000 long


def _chain_under_a_shape(op: str, length: int = 10_000) -> onnx.ModelProto:
    """A lookup ``Gather(table, ids)`` then ``length`` ops, under a Shape that feeds the output (the Shape's source
    is walked back to tell its shape from the ids')."""
    import numpy as np
    import onnx.numpy_helper as onh

    nodes, prev = [oh.make_node("Gather", ["table", "ids"], ["v0"])], "v0"
    for k in range(length):
        if op == "Gather":  # one index along the last axis, keeping the rank
            nodes.append(oh.make_node("Gather", [prev, "i"], [f"v{k + 1}"], axis=-1))
        elif op == "Add":
            nodes.append(oh.make_node("Add", [prev, "zero"], [f"v{k + 1}"]))
        else:
            nodes.append(oh.make_node(op, [prev], [f"v{k + 1}"]))
        prev = f"v{k + 1}"
    nodes.append(oh.make_node("Shape", [prev], ["s"]))
    inits = [onh.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table"),
             onh.from_array(np.array([0], np.int64), "i"), onh.from_array(np.array(0, np.float32), "zero")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                          [oh.make_tensor_value_info("s", TensorProto.INT64, [3])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("op", ["Gather", "Identity", "Add"])
def test_a_chain_10000_long_under_a_shape_is_left_as_it_is(tmp_path: Path, op: str):
    import numpy as np
    import onnxruntime as ort

    path, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    model = _chain_under_a_shape(op)
    onnx.save(model, path)
    proc = subprocess.run(_CLI + [str(path), "-o", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    feeds = {"ids": np.array([[1, 2, 3], [4, 5, 6]], np.int64)}
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds) for p in (path, out)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])


# ---------------------------------------------------------------------------------------------------------------
# leftovers: a sparse initializer of text, an input with a 0 dim


def test_a_sparse_initializer_of_strings_is_made_dense(tmp_path: Path):
    import numpy as np
    import onnxruntime as ort

    sparse = oh.make_sparse_tensor(oh.make_tensor("text", TensorProto.STRING, [2], [b"a", b"b"]),
                                   oh.make_tensor("at", TensorProto.INT64, [2], [0, 3]), [4])
    graph = oh.make_graph([oh.make_node("Identity", ["text"], ["s"]), oh.make_node("Relu", ["x"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                           oh.make_tensor_value_info("s", TensorProto.STRING, [4])], sparse_initializer=[sparse])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    proc = subprocess.run(_CLI + [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # ONNX Runtime cannot load the sparse original; the dense output holds what the sparse tensor means
    session = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"])
    _, text = session.run(None, {"x": np.ones(2, np.float32)})
    assert text.tolist() == ["a", "", "", "b"]


@pytest.mark.parametrize("shape", [[0, 8], [2, 0], [0, 0]])
def test_an_input_with_a_0_dim_is_fused_or_left_and_computes_the_same(tmp_path: Path, shape: list[int]):
    import numpy as np
    import onnx.numpy_helper as onh
    import onnxruntime as ort

    nodes = [oh.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), oh.make_node("Sub", ["x", "m"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["sq"]), oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             oh.make_node("Add", ["var", "eps"], ["ve"]), oh.make_node("Sqrt", ["ve"], ["std"]),
             oh.make_node("Div", ["d", "std"], ["y"])]
    inits = [onh.from_array(np.array(2, np.float32), "two"), onh.from_array(np.array(1e-5, np.float32), "eps")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    proc = subprocess.run(_CLI + [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode == 0:
        feeds = {"x": np.zeros(shape, np.float32)}
        runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                for p in (tmp_path / "m.onnx", tmp_path / "o.onnx")]
        assert runs[0].shape == runs[1].shape == tuple(shape)
    else:
        assert len(proc.stderr.strip().splitlines()) == 1


def _function_fanout(n: int) -> onnx.ModelProto:
    """f0 calls f1 twice, f1 calls f2 twice, ...: a kilobyte that ONNX Runtime and onnx's shape inference inline
    into 2^n nodes."""
    functions = [oh.make_function("loc", f"f{n}", ["a"], ["b"], [oh.make_node("Neg", ["a"], ["b"])],
                                  [oh.make_opsetid("", 18)])]
    for i in reversed(range(n)):
        functions.append(oh.make_function(
            "loc", f"f{i}", ["a"], ["b"], [oh.make_node(f"f{i + 1}", ["a"], ["t"], domain="loc"),
                                           oh.make_node(f"f{i + 1}", ["t"], ["b"], domain="loc")],
            [oh.make_opsetid("", 18), oh.make_opsetid("loc", 1)]))
    graph = oh.make_graph([oh.make_node("f0", ["x"], ["y"], domain="loc")], "g",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return oh.make_model(graph, functions=functions, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("loc", 1)])


@pytest.mark.parametrize("n", [8, 40])
def test_functions_that_call_each_other_twice_are_bounded(tmp_path: Path, n: int):
    """n = 40 describes 2^40 inlined nodes in 2 KB (it took hours, its time doubling with each level): refused at
    once in one line; n = 8 (256 nodes) fuses as any model does."""
    path = tmp_path / "m.onnx"
    onnx.save(_function_fanout(n), path)
    start = time.monotonic()
    proc = subprocess.run(_CLI + [str(path), "-o", str(tmp_path / "o.onnx")], capture_output=True, text=True,
                          timeout=300)
    if n == 8:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2 and "1,000,000 nodes" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and time.monotonic() - start < 60
