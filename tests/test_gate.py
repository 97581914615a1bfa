"""The gate as a mechanism: the one reader of a model folder re-checks the file on every read, never blocks, never
follows a link put in place after admission, and is the only way external bytes reach onnx_ir or ONNX Runtime."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx.external_data_helper import set_external_data

import lnfuse
from lnfuse.load import io
from lnfuse.errors import InputError
from lnfuse.load.gate import Gate, GatedTensor, ort_initializers
from lnfuse.verification.region import session
from normgraphs import Spec, build

SECRET = b"canary: these bytes live outside the model folder " * 8


def _external_gamma_model(folder: Path, hidden: int = 2048) -> tuple[Path, np.ndarray]:
    """A LayerNorm model whose gamma (large enough to stay lazy) is external data in folder/w.data."""
    model = build(Spec(hidden=hidden))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    values = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
    (folder / "w.data").write_bytes(values.tobytes())
    set_external_data(gamma, "w.data", 0, values.nbytes)
    gamma.ClearField("raw_data")
    gamma.ClearField("float_data")
    gamma.data_location = onnx.TensorProto.EXTERNAL
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path, values


def _gated(loaded: io.Loaded) -> GatedTensor:
    return next(v.const_value for v in loaded.model.graph.initializers.values()
                if isinstance(v.const_value, GatedTensor))


def test_weights_stay_lazy_and_read_through_the_gate(tmp_path: Path):
    path, values = _external_gamma_model(tmp_path)
    loaded = io.load(path)
    tensor = _gated(loaded)
    assert loaded.has_external_data and tensor.raw is None, "not read at load"
    np.testing.assert_array_equal(tensor.numpy(), values)


def test_setting_base_dir_does_not_redirect_the_read(tmp_path: Path):
    """onnx_ir's set_base_dir (or a script's own) cannot point a gated weight at another folder."""
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path, values = _external_gamma_model(tmp_path / "model")
    (tmp_path / "elsewhere" / "w.data").write_bytes(SECRET[:values.nbytes].ljust(values.nbytes, b"x"))
    loaded = io.load(path)
    ir.external_data.set_base_dir(loaded.model.graph, tmp_path / "elsewhere")
    np.testing.assert_array_equal(_gated(loaded).numpy(), values)


def test_a_relative_model_path_reads_the_same_after_chdir(tmp_path: Path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "decoy").mkdir()
    path, values = _external_gamma_model(tmp_path / "model")
    (tmp_path / "decoy" / "w.data").write_bytes(bytes(values.nbytes))
    monkeypatch.chdir(tmp_path)
    loaded = io.load(Path("model") / "model.onnx")
    monkeypatch.chdir(tmp_path / "decoy")  # the folder a relative base_dir would now resolve to holds a decoy
    np.testing.assert_array_equal(_gated(loaded).numpy(), values)


def test_a_data_file_swapped_for_a_link_after_admission_is_refused(tmp_path: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "secret").write_bytes(SECRET * 64)
    path, _ = _external_gamma_model(tmp_path / "model")
    loaded = io.load(path)
    data = tmp_path / "model" / "w.data"
    data.unlink()
    data.symlink_to(tmp_path / "secret")
    with pytest.raises(InputError, match="cannot be opened any more"):
        _gated(loaded).numpy()


def test_a_data_file_replaced_by_another_file_after_admission_is_refused(tmp_path: Path):
    path, values = _external_gamma_model(tmp_path)
    loaded = io.load(path)
    (tmp_path / "w.data").rename(tmp_path / "old.data")  # kept, so the new file cannot reuse its inode
    (tmp_path / "w.data").write_bytes(values.tobytes())  # same bytes, another file: not the one admitted
    with pytest.raises(InputError, match="replaced or shortened"):
        _gated(loaded).numpy()


def test_a_fifo_put_in_place_of_a_data_file_does_not_block(tmp_path: Path):
    path, _ = _external_gamma_model(tmp_path)
    loaded = io.load(path)
    (tmp_path / "w.data").unlink()
    os.mkfifo(tmp_path / "w.data")
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            _gated(loaded).numpy()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - the thread hands whatever happened to the test
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], InputError)


@pytest.mark.parametrize("special", ["fifo", "dev_zero_link"])
def test_special_data_files_are_refused_at_load(tmp_path: Path, special: str):
    path, _ = _external_gamma_model(tmp_path)
    (tmp_path / "w.data").unlink()
    if special == "fifo":
        os.mkfifo(tmp_path / "w.data")
    else:
        (tmp_path / "w.data").symlink_to("/dev/zero")
    with pytest.raises(InputError, match="gamma"):
        io.load(path)


def test_ort_is_never_handed_a_location_to_resolve(tmp_path: Path):
    """A session built for a model whose weight is external gets the weight in memory; without a gate it is
    refused as a bug rather than letting ONNX Runtime read the file itself."""
    path, values = _external_gamma_model(tmp_path)
    loaded = io.load(path)
    proto = ir.serde.serialize_model(loaded.model)
    _, names, arrays = ort_initializers(proto, loaded.gate)
    assert len(names) == 1 and np.array_equal(arrays[0], values)
    x = np.random.default_rng(1).standard_normal((3, 2, 2048)).astype(np.float32)
    feeds = {proto.graph.input[0].name: x}
    out = session(proto, gate=loaded.gate).run(None, feeds)[0]
    assert np.isfinite(out).all()
    with pytest.raises(RuntimeError, match="no gate"):
        session(proto)


def test_outside_the_main_graph_nothing_stays_external(tmp_path: Path):
    """A Constant inside an If body with external data is copied inline at load (from the model folder): no
    library later resolves it against the working directory."""
    model = build(Spec(hidden=8))
    value = np.arange(8, dtype=np.float32)
    (tmp_path / "c.data").write_bytes(value.tobytes())
    tensor = onnx.numpy_helper.from_array(value, "c")
    set_external_data(tensor, "c.data", 0, value.nbytes)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    branch = onnx.helper.make_graph([onnx.helper.make_node("Constant", [], ["c_out"], value=tensor)], "b", [],
                                    [onnx.helper.make_tensor_value_info("c_out", onnx.TensorProto.FLOAT, [8])])
    cond = onnx.numpy_helper.from_array(np.array(True), "cond")
    model.graph.initializer.append(cond)
    out = model.graph.output[0].name
    model.graph.node.append(onnx.helper.make_node("If", ["cond"], ["picked"], then_branch=branch,
                                                  else_branch=branch))
    model.graph.node.append(onnx.helper.make_node("Add", [out, "picked"], ["y2"]))
    model.graph.output[0].name = "y2"
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    gate = Gate(tmp_path, str(path))
    proto = onnx.load(path, load_external_data=False)
    gate.admit_all(proto)
    inlined = next(a.t for n in proto.graph.node if n.op_type == "If" for a in n.attribute
                   if a.name == "then_branch" for a in a.g.node[0].attribute)
    assert inlined.data_location == onnx.TensorProto.DEFAULT
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(inlined), value)
    result = lnfuse.fuse(path, verify_model=True)
    assert result.report.fused_counts() == {"LayerNormalization": 1}
    assert result.report.model_check["ok"]


# -- the red team's holes (issue 19's review), each a door closed at its mechanism ------------------------------------

def _run_from(cwd: Path, *argv: str) -> tuple[int, str]:
    import contextlib
    import io as text_io

    from lnfuse.cli import main

    here, err = os.getcwd(), text_io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(text_io.StringIO()):
            code = main(list(argv))
    finally:
        os.chdir(here)
    return code, err.getvalue()


def _externalize(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def test_a_tensor_forged_like_lnfuses_placeholder_is_external_data_like_any_other(tmp_path: Path):
    """A sparse tensor's values naming the model file at the offset, length, type and shape of one of its large
    inline weights looked like lnfuse's own placeholder, skipped the gate, and were read from the working
    directory's file of that name. Only a weight's slot can hold a placeholder."""
    for name in ("model", "out", "cwd"):
        (tmp_path / name).mkdir()
    hidden = 2048
    model = build(Spec(hidden=hidden))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    model.graph.initializer.remove(gamma)
    weight = np.arange(hidden, dtype=np.float32) * 1e-3 + 1
    model.graph.initializer.append(onnx.numpy_helper.from_array(weight, "W"))
    values = onnx.helper.make_tensor(gamma.name, onnx.TensorProto.FLOAT, [hidden], np.zeros(hidden, np.float32))
    _externalize(values, "model.onnx", 0, hidden * 4)
    indices = onnx.numpy_helper.from_array(np.arange(hidden, dtype=np.int64), "idx")
    model.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [hidden]))
    for _ in range(3):  # the offset's digits change the file's layout: settle where the weight lies
        at = model.SerializeToString().find(weight.tobytes())
        next(e for e in model.graph.sparse_initializer[0].values.external_data if e.key == "offset").value = str(at)
    path = tmp_path / "model" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    (tmp_path / "cwd" / "model.onnx").write_bytes(SECRET * 400)
    out = tmp_path / "out" / "o.onnx"
    code, err = _run_from(tmp_path / "cwd", str(path), "-o", str(out))
    assert code in (0, 2), err
    if code == 0:
        assert SECRET[:16] not in out.read_bytes()
        fused = onnx.load(out)
        gamma_now = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}
        assert any(np.array_equal(v, weight) for v in gamma_now.values()), "gamma is the model file's own bytes"


def test_external_data_in_a_functions_attribute_default_is_admitted(tmp_path: Path):
    """A model-local function's attribute default (FunctionProto.attribute_proto) holding external data was never
    admitted: ONNX Runtime read '.env' from the working directory under --verify model."""
    for name in ("model", "out", "cwd", "empty"):
        (tmp_path / name).mkdir()
    model = build(Spec(hidden=64))
    default = onnx.helper.make_tensor("g", onnx.TensorProto.FLOAT, [64], np.ones(64, np.float32))
    _externalize(default, ".env", 0, 256)
    constant = onnx.helper.make_node("Constant", [], ["gv"])
    constant.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="g", type=onnx.AttributeProto.TENSOR))
    function = onnx.helper.make_function("custom", "F", ["x"], ["y"],
                                         [constant, onnx.helper.make_node("Mul", ["x", "gv"], ["y"])],
                                         [onnx.helper.make_opsetid("", 17)], attributes=[])
    function.attribute_proto.append(onnx.helper.make_attribute("g", default))
    out = model.graph.output[0].name
    model.graph.output[0].name = "final"
    model.graph.node.append(onnx.helper.make_node("F", [out], ["final"], domain="custom"))
    model.opset_import.append(onnx.helper.make_opsetid("custom", 1))
    model.functions.append(function)
    path = tmp_path / "model" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    (tmp_path / "cwd" / ".env").write_bytes(SECRET)
    outcomes = [_run_from(tmp_path / where, str(path), "-o", str(tmp_path / "out" / "o.onnx"), "--verify", "model")
                for where in ("cwd", "empty")]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == 2 and "'.env'" in outcomes[0][1] and "missing" in outcomes[0][1]


def test_an_onnx_ir_model_is_read_from_the_folder_its_constants_name(tmp_path: Path, monkeypatch):
    """An onnx_ir.Model whose only external tensor is a Constant's value was anchored at the working directory."""
    (tmp_path / "model").mkdir()
    (tmp_path / "cwd").mkdir()
    model = build(Spec(hidden=2048))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    model.graph.initializer.remove(gamma)
    values = np.random.default_rng(3).uniform(0.5, 1.5, 2048).astype(np.float32)
    (tmp_path / "model" / "w.data").write_bytes(values.tobytes())
    tensor = onnx.numpy_helper.from_array(values, gamma.name)
    _externalize(tensor, "w.data", 0, values.nbytes)
    model.graph.node.insert(0, onnx.helper.make_node("Constant", [], [gamma.name], value=tensor))
    path = tmp_path / "model" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    (tmp_path / "cwd" / "w.data").write_bytes(SECRET * 64)
    loaded = ir.load(path)
    monkeypatch.chdir(tmp_path / "cwd")
    result = lnfuse.fuse(loaded)
    norm = next(n for n in result.ir_model.graph if n.op_type == "LayerNormalization")
    np.testing.assert_array_equal(norm.inputs[1].const_value.numpy(), values)


def test_sparse_tensors_share_one_budget(tmp_path: Path):
    """Six sparse initializers of a few bytes, each just under the per-tensor limit, took 3 GB: the limit is for
    all of them together, checked before any is made dense."""
    model = build(Spec(hidden=8))
    side = 2048
    for k in range(6):
        values = onnx.numpy_helper.from_array(np.ones(1, np.float32), f"sp{k}")
        indices = onnx.numpy_helper.from_array(np.zeros(1, np.int64), f"sp{k}_idx")
        model.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [side, side, 3]))
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(InputError, match="in all"):
        io.load(path)
