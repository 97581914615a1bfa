"""Whole-model check: run the original and the fused model in ORT on the same inputs, worst difference per output."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.errors import InputError, UsageError, first_line
from lnfuse.verify import TOLERANCE, compare, session

_DIM_SIZES = (2, 5, 3, 4, 6, 7)


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds for the graph inputs: floats ~N(0,1); integers 0/1, valid ids for any table and a valid mask."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    sizes: dict[str, int] = {}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = []
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            else:
                key = dim.dim_param or f"?{len(sizes)}"
                shape.append(sizes.setdefault(key, _DIM_SIZES[len(sizes) % len(_DIM_SIZES)]))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def compare_models(original: onnx.ModelProto, fused: onnx.ModelProto, inputs: dict[str, np.ndarray] | None = None,
                   base_dir: Path | None = None) -> dict:
    """``{"ok", "summary", "outputs": {name: max_abs_diff}}`` for the two models on the same inputs."""
    feeds = inputs if inputs is not None else random_inputs(original)
    if inputs is not None:
        _check_feeds(original, inputs)
    try:
        expected = _run(original, feeds, base_dir)
    except Exception as error:  # noqa: BLE001 - ORT raises several types; its message is what the user needs
        raise InputError(f"ONNX Runtime cannot run the original model ({first_line(error)}); the whole-model "
                         "check needs it: run without --verify model") from None
    try:
        actual = _run(fused, feeds, base_dir)
    except Exception as error:  # noqa: BLE001
        return {"ok": False, "summary": f"DIFFER; the fused model does not run ({first_line(error)})",
                "outputs": {}}
    dtypes = {v.name: v.type.tensor_type.elem_type for v in original.graph.output}
    outputs, ok = {}, True
    for name, want in expected.items():
        atol, rtol = _tolerance(dtypes.get(name))
        err, passed = compare(want, actual[name], atol, rtol)
        outputs[name] = err
        ok = ok and passed
    worst = max(outputs.values()) if outputs else 0.0
    summary = f"{'agree' if ok else 'DIFFER'}; worst output difference {worst:.2e} over {len(outputs)} output(s)"
    return {"ok": ok, "summary": summary, "outputs": outputs}


def _check_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """User-given inputs must name every graph input, with its dtype and rank."""
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if value.name not in feeds:
            raise UsageError(f"--inputs has no array named '{value.name}' (it has {sorted(feeds)})")
        tensor = value.type.tensor_type
        want = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        got = feeds[value.name]
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if got.dtype != want or got.ndim != len(dims) or any(d not in (None, g) for d, g in zip(dims, got.shape)):
            shape = [d if d is not None else "?" for d in dims]
            raise UsageError(f"--inputs '{value.name}' is {got.dtype}{list(got.shape)}; the model takes {want}"
                             f"{shape}")


def _tolerance(elem_type: int | None) -> tuple[float, float]:
    if elem_type is None:
        return TOLERANCE[ir.DataType.FLOAT]
    # whole models accumulate rounding over many layers: 10x the single-op tolerance
    atol, rtol = TOLERANCE.get(ir.DataType(elem_type), TOLERANCE[ir.DataType.FLOAT])
    return atol * 10, rtol * 10


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], base_dir: Path | None) -> dict[str, np.ndarray]:
    if base_dir is not None and any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        # external data locations are relative to the model file: run it from beside the data
        with tempfile.NamedTemporaryFile(dir=base_dir, suffix=".lnfuse-check.onnx") as tmp:
            tmp.write(model.SerializeToString())
            tmp.flush()
            sess = session(tmp.name)
    else:
        sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items()
                                           if k in {i.name for i in sess.get_inputs()}})))
