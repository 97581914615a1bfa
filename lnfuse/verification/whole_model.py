"""Whole-model check: run the original and the fused model in ORT on the same inputs, worst difference per output."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.errors import InputError, UsageError, first_line
from lnfuse.load.gate import Gate
from lnfuse.index.library_budget import first_oversized
from lnfuse.verification.region import BUDGET, ID_MOVES, TOLERANCE, compare, dim_size, session
from lnfuse.index.ops import is_op, onnx_op

#: sizes tried for the spatial dims of an image (read by a 2-D or 3-D Conv) or a signal (a 1-D Conv), in order: the
#: sizes models are trained at come first, since a position table may fix them; each try is one run of the model
_SPATIAL_TRIES = {2: (32, 64, 224, 16, 128, 256, 384, 512), 1: (400, 1600, 4000, 16000)}
#: ops that keep the axes of their first input in place (the way from a pixel input to its first Conv)
_SAME_AXES = frozenset({"Cast", "Identity", "Add", "Sub", "Mul", "Div", "Pad", "Relu", "Clip", "CastLike"})
_ID_ROWS = 64
_SAME_SIZES = (4, 1)


#: the most elements a model run whole (``--verify model``) may compute from constants beyond the data it reads,
#: all nodes together: 2^27 (512 MiB of float32), a whole-model run's own budget, beside ``budget.MAX_ELEMENTS``
#: for what lnfuse folds itself
RUN_ELEMENTS = 1 << 27


class NoRunnableInputs(InputError):
    """No inputs lnfuse builds make ONNX Runtime run the model; the user must give them with --inputs."""


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds for the graph inputs, of the first sizes ``model_inputs`` would try (no run)."""
    plan = _InputPlan(model)
    return plan.feeds(plan.attempts()[0], seed)


def model_inputs(model: onnx.ModelProto, seed: int = 0, option: str = "--verify model",
                 gate: Gate | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, outputs): inputs the model runs on in ONNX Runtime, built from the graph as a user would, and
    what the model computes on them. Raises ``NoRunnableInputs`` naming ``option`` (what needs them) and the
    inputs to give with ``--inputs FILE.npz``.

    Sizes: a dim a Conv reads as channels takes the weight's channel count; a dim named as an expression of others
    (``past_sequence_length + sequence_length``) takes its value; spatial dims of Conv inputs are tried at common
    image/signal sizes; other symbolic dims get small sizes, the same for the same name. Integer inputs that are
    lookup ids stay below their table's rows; other integers are 0/1 (a valid mask), floats ~N(0, 1)."""
    plan = _InputPlan(model)
    if isinstance(model, onnx.ModelProto):
        _within_budget(model, option)
    try:
        sess, errors = _session(model, gate), []
    except Exception as error:  # noqa: BLE001 - ORT raises several types; its message is what the user needs
        raise InputError(f"ONNX Runtime cannot run the original model ({first_line(error)}); {option} needs it: "
                         f"run without {option}") from None
    for sizes in plan.attempts():
        feeds = plan.feeds(sizes, seed)
        try:
            return feeds, _outputs(sess, feeds)
        except Exception as error:  # noqa: BLE001 - ORT raises several types; the message is what matters
            errors.append(first_line(error))
    raise NoRunnableInputs(
        f"{option} needs to run the original model, and ONNX Runtime ran it on none of the {len(errors)} input "
        f"set(s) lnfuse built from the graph (last: {errors[-1][:200]}); give inputs with --inputs FILE.npz "
        f"holding {plan.describe()}")


class _InputPlan:
    """The graph inputs, and what the graph says about their sizes and values."""

    def __init__(self, model: onnx.ModelProto):
        initializers = {t.name: t for t in model.graph.initializer}
        self.inputs = [v for v in model.graph.input if v.name not in initializers]
        self.keys: dict[str, list[int | str]] = {}
        for value in self.inputs:
            self.keys[value.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
                                     (d.dim_param or f"?{value.name}:{axis}")
                                     for axis, d in enumerate(value.type.tensor_type.shape.dim)]
        self.fixed: dict[str, int] = {}
        self.spatial: dict[str, int] = {}
        self.bounds: dict[str, int] = {}
        readers, constants = _readers(model.graph), _constants(model.graph)
        for value in self.inputs:
            self._follow(value.name, list(range(len(self.keys[value.name]))), value.name, readers, constants)

    def _follow(self, name: str, axes: list[int | None], source: str, readers, initializers) -> None:
        """Walk from a graph input along ops that keep its axes to the Convs and Gathers that read it: ``axes``
        maps each axis of ``name`` to the input's axis (None for an inserted one)."""
        for node, index in readers.get(name, ()):
            if onnx_op(node) in ("Conv", "ConvTranspose") and index == 0:
                self._conv(node, axes, source, initializers)
            elif is_op(node, "Gather") and index == 1 and node.input[0] in initializers:
                rows = initializers[node.input[0]].dims[_axis(node) if _axis(node) >= 0 else 0]
                self.bounds[source] = min(self.bounds.get(source, rows), rows)
            elif onnx_op(node) in ID_MOVES and index == 0 and not is_op(node, "Unsqueeze"):
                if onnx_op(node) in ("Cast", "Identity"):
                    self._follow(node.output[0], axes, source, readers, initializers)
                else:
                    self._follow_ids(node.output[0], source, readers, initializers)
            elif is_op(node, "Unsqueeze") and index == 0:
                inserted = _unsqueeze_axes(node, initializers, len(axes))
                if inserted is not None:
                    moved = list(axes)
                    for a in sorted(inserted):
                        moved.insert(a, None)
                    self._follow(node.output[0], moved, source, readers, initializers)
            elif onnx_op(node) in _SAME_AXES and index == 0:
                self._follow(node.output[0], axes, source, readers, initializers)

    def _follow_ids(self, name: str, source: str, readers, initializers) -> None:
        for node, index in readers.get(name, ()):
            if is_op(node, "Gather") and index == 1 and node.input[0] in initializers:
                rows = initializers[node.input[0]].dims[_axis(node) if _axis(node) >= 0 else 0]
                self.bounds[source] = min(self.bounds.get(source, rows), rows)
            elif onnx_op(node) in ID_MOVES and index == 0:
                self._follow_ids(node.output[0], source, readers, initializers)

    def _conv(self, node: onnx.NodeProto, axes: list[int | None], source: str, initializers) -> None:
        weight = initializers.get(node.input[1])
        keys = self.keys[source]
        if weight is None or len(axes) < 3:
            return
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        channels = weight.dims[1] * group if is_op(node, "Conv") else weight.dims[0]
        if axes[1] is not None and isinstance(keys[axes[1]], str):
            self.fixed[keys[axes[1]]] = channels
        for axis in axes[2:]:
            if axis is not None and isinstance(keys[axis], str):
                self.spatial[keys[axis]] = min(len(axes) - 2, 2)

    def attempts(self) -> list[dict[str, int]]:
        """Preset sizes for each try: the fixed channel counts, then each spatial size in turn."""
        tries = max((len(_SPATIAL_TRIES[k]) for k in self.spatial.values()), default=1)
        attempts = []
        for i in range(tries):
            sizes = dict(self.fixed)
            for key, kind in self.spatial.items():
                options = _SPATIAL_TRIES[kind]
                sizes[key] = options[min(i, len(options) - 1)]
            attempts.append(sizes)
        # last: every free dim the same size (a mask named apart from the ids it masks, with no past), then 1 (a
        # decoder step whose mask is named 'past_sequence_length + 1')
        free = {k for keys in self.keys.values() for k in keys if isinstance(k, str) and k not in attempts[-1]
                and (k.startswith("?") or k.isidentifier())}
        base = attempts[-1]
        attempts += [{**base, **{k: size for k in free}} for size in _SAME_SIZES if free]
        return attempts

    def feeds(self, preset: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        sizes = dict(preset)
        shapes = {v.name: [k if isinstance(k, int) else dim_size(k, sizes) for k in self.keys[v.name]]
                  for v in self.inputs}
        dtypes = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) for v in self.inputs}
        total = sum(math.prod(shape) * dtypes[name].itemsize for name, shape in shapes.items())
        if total > BUDGET:
            raise NoRunnableInputs(f"the model's inputs would take {total / 2**20:,.0f} MiB, over the "
                                   f"{BUDGET >> 20} MiB lnfuse allocates to run it; give inputs with --inputs "
                                   f"FILE.npz holding {self.describe()}")
        feeds = {}
        for name, shape in shapes.items():
            dtype = dtypes[name]
            if np.issubdtype(dtype, np.floating):
                feeds[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            elif dtype == np.bool_:
                feeds[name] = rng.integers(0, 2, size=shape).astype(bool)
            else:
                feeds[name] = rng.integers(0, min(self.bounds.get(name, 2), _ID_ROWS), size=shape).astype(dtype)
        return feeds

    def describe(self) -> str:
        return ", ".join(f"{v.name} {onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)}"
                         f"[{', '.join(str(k) if not str(k).startswith('?') else '?' for k in self.keys[v.name])}]"
                         for v in self.inputs)


def _readers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    readers: dict[str, list] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, index))
    return readers


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant nodes' values, by name (only their dims are read, and a Unsqueeze's axes)."""
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if is_op(node, "Constant"):
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants[node.output[0]] = value
    return constants


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _unsqueeze_axes(node: onnx.NodeProto, initializers, rank: int) -> list[int] | None:
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1] in initializers:
        axes = onnx.numpy_helper.to_array(initializers[node.input[1]]).reshape(-1).tolist()
    if axes is None:
        return None
    out_rank = rank + len(axes)
    return [a % out_rank for a in axes]


def compare_models(original: onnx.ModelProto, fused: onnx.ModelProto, inputs: dict[str, np.ndarray] | None = None,
                   gate: Gate | None = None, option: str = "--verify model") -> dict:
    """``{"ok", "summary", "outputs": {name: max_abs_diff}}`` for the two models on the same inputs (``inputs``,
    or ones built by ``model_inputs``; ``option`` names what needs them in the error when none can be built)."""
    _within_budget(original, option)
    if inputs is not None:
        _check_feeds(original, inputs)
        try:
            feeds, expected = inputs, _outputs(_session(original, gate), inputs)
        except Exception as error:  # noqa: BLE001 - ORT raises several types; its message is what the user needs
            raise InputError(f"ONNX Runtime cannot run the original model on the --inputs arrays "
                             f"({first_line(error)}); {option} needs it: fix the arrays or run without "
                             f"{option}") from None
    else:
        feeds, expected = model_inputs(original, option=option, gate=gate)
    try:
        actual = _outputs(_session(fused, gate), feeds)
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


def _within_budget(model: onnx.ModelProto, option: str) -> None:
    """Running the model makes ONNX Runtime compute every value, also those a few bytes describe as gigabytes
    (``ConstantOfShape([2**31])``): a model whose nodes would make more than ``RUN_ELEMENTS`` in all from
    constants, beyond the data they read, is not run. Real models do compute large constants (a causal mask of
    2048 x 2048); fp16 weights cast to fp32 are as large as the weights the file holds and do not count."""
    node = first_oversized(model, RUN_ELEMENTS)
    if node is not None:
        raise InputError(f"{option} would run the model, and its {node} brings what it computes from constants past "
                         f"{RUN_ELEMENTS:,} elements beyond the data it holds; run without {option}")


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
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tensor.shape.dim]
        if got.dtype != want or got.ndim != len(dims) or any(d not in (None, g) for d, g in zip(dims, got.shape)):
            shape = ",".join("?" if d is None else str(d) for d in dims)
            raise UsageError(f"--inputs '{value.name}' is {got.dtype}[{','.join(map(str, got.shape))}]; the model "
                             f"takes {want}[{shape}]")


def _tolerance(elem_type: int | None) -> tuple[float, float]:
    if elem_type is None:
        return TOLERANCE[ir.DataType.FLOAT]
    # whole models accumulate rounding over many layers: 10x the single-op tolerance
    atol, rtol = TOLERANCE.get(ir.DataType(elem_type), TOLERANCE[ir.DataType.FLOAT])
    return atol * 10, rtol * 10


def _session(model: onnx.ModelProto, gate: Gate | None):
    # the model's external weights are read through its folder's gate and handed to ORT in memory
    return session(model, gate=gate)


def _outputs(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def read_inputs(path: str) -> dict[str, np.ndarray]:
    """``--inputs FILE.npz``: input name -> array, or ``UsageError`` saying what to give (a file that is not an .npz,
    an .npy, a pickle, a damaged archive)."""
    import zipfile

    try:
        with np.load(path) as arrays:  # no pickles: allow_pickle stays False
            return {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, AttributeError, TypeError) as error:
        said = first_line(error) if str(error) else type(error).__name__
        raise UsageError(f"{path}: cannot read inputs ({said}); give an .npz of input name -> array (numpy.savez)")\
            from None
