"""Regression tests for the attacks of issue 19 that read bytes around the trust gate (its first four bullets, and
the external-data cases of the later ones): sparse tensors with external values or indices, a small external
Constant whose bytes reach declared shapes, Constants with external data inside functions and If/Loop bodies,
external-data locations that are not UTF-8, and a main-graph Constant with external data written to another folder.

Every model is built here from a small norm graph. Each (attack, command) runs the real CLI (``lnfuse.cli.main`` in
this process; a few through a real process) twice: from a working directory seeded with canary files (named like
every data file of the model folder, every common secret, and every name and location the model mentions, see
``seed_cwd``) and from an empty one. The contract, for every command:

- exit 0 with outputs ONNX Runtime loads, or exit 2 with exactly one line on stderr and nothing written
  (``check`` may also exit 1: a candidate left unfused);
- no canary byte in any output: model, data files, report, annotated copy, stdout (JSON or tables), stderr, and the
  declared shapes and tensor values of every written model (``leaks``);
- nothing created or changed outside the output folder; the model folder unchanged (hashes);
- the same outcome (exit code, stdout/stderr, every output file's bytes; only run times are ignored) from the
  seeded and the empty working directory.

The harness (``seed_cwd``, ``run_both``, ``leaks``) is shared with tests/test_cwd_canary.py, which runs the same
property over the security tests', the fuzzer's and the sample models.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lnfuse.cli import main
from normgraphs import Spec, build

# ------------------------------------------------------------------------------------------------ canary files

#: every canary byte string starts with this; no model in the suite holds it
MARKER = b"LNCNRY"
#: files every developer's home or project folder may hold
COMMON_SECRETS = (".env", ".ssh/id_rsa", ".aws/credentials", "id_rsa", "secret.bin")


class Canaries:
    """Unique canary contents: an 8-byte unit ``LNCNRY`` + a 2-byte tag, repeated. Any 8 aligned bytes of a canary
    file hold the marker, so does each int64 read from one (a declared dim), and each run of its bytes cast to
    small ints (uint8 dims)."""

    def __init__(self):
        self.count = 0
        self.numbers: set[str] = set()  # the int64 value of each unit, as text (a dim printed in a message)

    def content(self, size: int) -> bytes:
        self.count += 1
        unit = MARKER + (self.count % 65536).to_bytes(2, "little")
        self.numbers.add(str(int.from_bytes(unit, "little", signed=True)))
        return (unit * (size // 8 + 1))[:max(size, 8)]


def _safe_relative(name: str | bytes) -> Path | None:
    """A name as a relative path under the working directory, or None if it cannot be one (a ``..``, a NUL, a
    component too long). A leading '/' is dropped: '/encoder/Add' is seeded as encoder/Add."""
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")
    raw = raw.lstrip(b"/")
    parts = [p for p in raw.split(b"/") if p and p != b"."]
    if not parts or b"\0" in raw or any(p == b".." or len(p) > 200 for p in parts) or len(raw) > 1000:
        return None
    return Path(os.fsdecode(b"/".join(parts)))


def model_strings(proto: onnx.ModelProto) -> set[str]:
    """Every name and location the model mentions: graphs, nodes, values, tensors (dense, sparse values and
    indices, attributes), functions, external-data locations, metadata keys, in every graph and function."""
    found: set[str] = set()

    def tensor(t: TensorProto):
        found.add(t.name)
        found.update(e.value for e in t.external_data if e.key == "location")

    def sparse(s: onnx.SparseTensorProto):
        tensor(s.values)
        tensor(s.indices)

    def nodes(ns):
        for n in ns:
            found.update([n.name, n.op_type, n.domain, *n.input, *n.output])
            for a in n.attribute:
                found.add(a.name)
                if a.HasField("t"):
                    tensor(a.t)
                if a.HasField("sparse_tensor"):
                    sparse(a.sparse_tensor)
                for t in a.tensors:
                    tensor(t)
                for s in a.sparse_tensors:
                    sparse(s)
                if a.HasField("g"):
                    graph(a.g)
                for g in a.graphs:
                    graph(g)

    def graph(g: onnx.GraphProto):
        found.add(g.name)
        for t in g.initializer:
            tensor(t)
        for s in g.sparse_initializer:
            sparse(s)
        for v in list(g.input) + list(g.output) + list(g.value_info):
            found.add(v.name)
        nodes(g.node)

    graph(proto.graph)
    for f in proto.functions:
        found.update([f.name, f.domain, *f.input, *f.output])
        nodes(f.node)
    found.update(p.key for p in proto.metadata_props)
    found.discard("")
    return found


def seed_cwd(cwd: Path, model_folder: Path, canaries: Canaries, extra: tuple[str | bytes, ...] = ()) -> int:
    """Fill ``cwd`` with canary files: one named like each file of the model folder (same size), each common
    secret, and each string the model files mention. Returns how many were written."""
    sizes: dict[Path, int] = {}
    for dirpath, _dirs, files in os.walk(model_folder):
        for name in files:
            path = Path(dirpath) / name
            rel = path.relative_to(model_folder)
            sizes[rel] = max(path.stat().st_size if not path.is_symlink() else 0, 64)
            if path.suffix == ".onnx":
                try:
                    proto = onnx.load(path, load_external_data=False)
                except Exception:  # noqa: BLE001 - a model made unparsable on purpose: names come from ``extra``
                    continue
                for s in model_strings(proto):
                    if (p := _safe_relative(s)) is not None:
                        sizes.setdefault(p, 4096)
    for s in list(COMMON_SECRETS) + list(extra):
        if (p := _safe_relative(s)) is not None:
            sizes.setdefault(p, 4096)
    written = 0
    for rel, size in sorted(sizes.items(), key=lambda item: len(item[0].parts)):
        target = cwd / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                continue  # a name that is also a folder of another name
            target.write_bytes(canaries.content(size))
            written += 1
        except (NotADirectoryError, FileExistsError, IsADirectoryError, OSError):
            continue  # 'a' is a file and 'a/b' a name: one of them is enough
    return written


# ------------------------------------------------------------------------------------------------ detecting leaks

def _dims_bytes(proto: onnx.ModelProto) -> bytes:
    """Every declared dim and tensor dim of the model, as int64 and int32 little-endian bytes and, for runs of
    small dims, as bytes: dims made of a canary's bytes (read as int64, int32 or uint8) show the marker in one of
    these forms."""
    shapes: list[list[int]] = []

    def type_dims(tp: onnx.TypeProto):
        for kind in ("tensor_type", "sparse_tensor_type"):
            if tp.HasField(kind):
                shapes.append([d.dim_value for d in getattr(tp, kind).shape.dim])
        if tp.HasField("sequence_type"):
            type_dims(tp.sequence_type.elem_type)
        if tp.HasField("optional_type"):
            type_dims(tp.optional_type.elem_type)

    def graph(g):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            type_dims(v.type)
        for t in g.initializer:
            shapes.append(list(t.dims))
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    shapes.append(list(a.t.dims))
                shapes.append(list(a.ints))
                if a.HasField("g"):
                    graph(a.g)
                for sub in a.graphs:
                    graph(sub)

    graph(proto.graph)
    for f in proto.functions:
        for v in f.value_info:
            type_dims(v.type)
        graph(onnx.GraphProto(node=f.node))
    out = bytearray()
    for dims in shapes:
        out += b"|" + np.array(dims, dtype=np.int64).tobytes()
        if dims and all(-2 ** 31 <= d < 2 ** 32 for d in dims):
            out += b"|" + np.array(dims, dtype=np.int64).astype(np.uint32).tobytes()
        if dims and all(0 <= d < 256 for d in dims):
            out += b"|" + bytes(dims)
    return bytes(out)


def _decoded_values(proto: onnx.ModelProto) -> bytes:
    """Tensor values not stored as raw bytes (float_data, int64_data, ...): their bytes as numpy holds them."""
    out = bytearray()

    def tensors(g):
        yield from g.initializer
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("g"):
                    yield from tensors(a.g)
                for sub in a.graphs:
                    yield from tensors(sub)

    for t in tensors(proto.graph):
        if t.raw_data or t.data_location == TensorProto.EXTERNAL or t.data_type == TensorProto.STRING:
            continue
        with contextlib.suppress(Exception):
            out += onh.to_array(t).tobytes()
    return bytes(out)


def leaks(files: dict[str, bytes], texts: dict[str, str], canaries: Canaries) -> list[str]:
    """Where a canary byte string shows: in a written file (as bytes, in a model's declared dims or decoded
    values), or in printed text (as bytes or as the int64 number of a canary unit)."""
    found = []
    for name, data in files.items():
        if MARKER in data:
            found.append(f"{name}: canary bytes at offset {data.find(MARKER)}")
        if name.endswith(".onnx"):
            try:
                proto = onnx.ModelProto.FromString(data)
            except Exception:  # noqa: BLE001 - not parsable: the raw search above is all we can do
                continue
            if MARKER in _dims_bytes(proto):
                found.append(f"{name}: canary bytes in declared shapes")
            if MARKER in _decoded_values(proto):
                found.append(f"{name}: canary bytes in tensor values")
    for name, text in texts.items():
        if MARKER.decode() in text:
            found.append(f"{name}: canary text {text[text.find(MARKER.decode()) - 40:][:120]!r}")
        numbers = set(re.findall(r"-?\d{12,}", text)) & canaries.numbers
        if numbers:
            found.append(f"{name}: canary bytes as a number {sorted(numbers)[0]}")
    return found


# ------------------------------------------------------------------------------------------------ running lnfuse

def snapshot(root: Path, skip: Path) -> dict[str, str]:
    """Every entry under ``root`` except ``skip``: a link's target, a file's hash and mode (a before/after)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d != skip]
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                st = path.stat()
                found[str(path)] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {st.st_mode:o} {st.st_nlink}"
            else:
                found[str(path)] = "dir"
    return found


@contextlib.contextmanager
def working_directory(path: Path):
    """chdir for the block; the previous working directory is restored whatever happens."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    files: dict[str, bytes] = field(default_factory=dict)

    def normalized(self) -> tuple:
        """What must not depend on the working directory: all of it but run times."""
        return (self.code, _untimed(self.stdout), _untimed(self.stderr),
                {name: _untimed_file(name, data) for name, data in sorted(self.files.items())})


def _drop_times(value):
    if isinstance(value, dict):
        return {k: _drop_times(v) for k, v in value.items() if k not in ("seconds",)}
    if isinstance(value, list):
        return [_drop_times(v) for v in value]
    return value


def _untimed(text: str) -> str:
    stripped = text.strip()
    if stripped.startswith("{"):
        with contextlib.suppress(ValueError):
            return json.dumps(_drop_times(json.loads(stripped)), sort_keys=True)
    return re.sub(r"\b\d+\.\d+ s\b", "<t> s", text)


def _untimed_file(name: str, data: bytes) -> bytes:
    if name.endswith(".json"):
        with contextlib.suppress(ValueError):
            return json.dumps(_drop_times(json.loads(data)), sort_keys=True).encode()
    return data


def _read_outputs(out: Path) -> dict[str, bytes]:
    files = {}
    for dirpath, _dirs, names in os.walk(out):
        for name in names:
            path = Path(dirpath) / name
            files[str(path.relative_to(out))] = b"-> " + os.readlink(path).encode() if path.is_symlink() \
                else path.read_bytes()
    return files


def run_in(cwd: Path, argv: list[str], out: Path, subprocess_run: bool = False) -> Outcome:
    """The real CLI from ``cwd``: ``main()`` in this process (stdout and stderr captured), or a real process."""
    if subprocess_run:
        proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", *argv], capture_output=True, text=True,
                              timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": ""})
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        stdout_io, stderr_io = io.StringIO(), io.StringIO()
        with working_directory(cwd), contextlib.redirect_stdout(stdout_io), contextlib.redirect_stderr(stderr_io):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse
                code = exit_.code if isinstance(exit_.code, int) else 2
        stdout, stderr = stdout_io.getvalue(), stderr_io.getvalue()
    return Outcome(code, stdout, stderr, _read_outputs(out))


#: command name -> argv, given the model, the output folder; every output goes into that folder
COMMANDS = {
    "fuse": lambda m, o: [m, "-o", f"{o}/o.onnx"],
    "fuse_no_verify": lambda m, o: [m, "-o", f"{o}/o.onnx", "--no-verify"],
    "fuse_verify_model": lambda m, o: [m, "-o", f"{o}/o.onnx", "--verify", "model"],
    "fuse_report_json": lambda m, o: [m, "-o", f"{o}/o.onnx", "--report", f"{o}/r.json", "--json", "-v"],
    "fuse_single_onnx": lambda m, o: [m, "-o", f"{o}/o.onnx", "--external-data", "single", "--target", "onnx"],
    "explain": lambda m, o: ["explain", m, "-v"],
    "explain_json": lambda m, o: ["explain", m, "--json", "--no-verify"],
    "explain_annotate": lambda m, o: ["explain", m, "--annotate", f"{o}/a.onnx"],
    "check": lambda m, o: ["check", m, "-v"],
    "decompose": lambda m, o: ["decompose", m, "-o", f"{o}/d.onnx"],
    "decompose_no_verify": lambda m, o: ["decompose", m, "-o", f"{o}/d.onnx", "--no-verify"],
}
#: the commands without verification (none of them runs the model in ONNX Runtime)
NO_VERIFY = ("fuse_no_verify", "explain_json", "decompose_no_verify")


def _ort_loads(path: Path, cwd: Path) -> str | None:
    """None if ONNX Runtime loads the model (from an empty working directory), else why not."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with working_directory(cwd):
        try:
            ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as error:  # noqa: BLE001 - any refusal is the finding
            return str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return None


@dataclass
class Sandbox:
    """root/model (untrusted), root/outside (secrets beside it), root/cwd (seeded), root/empty, root/out."""
    root: Path
    canaries: Canaries = field(default_factory=Canaries)

    def __post_init__(self):
        for name in ("model", "outside", "cwd", "empty", "out"):
            (self.root / name).mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name):
        if name in ("model", "outside", "cwd", "empty", "out"):
            return self.root / name
        raise AttributeError(name)

    def secret(self, relative: str, size: int = 4096) -> Path:
        """A canary file outside the model folder (for absolute and '../' locations)."""
        path = self.outside / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.canaries.content(size))
        return path


def run_both(box: Sandbox, model: Path, command: str, *, input_loads: bool | None, extra: tuple = (),
             subprocess_run: bool = False) -> tuple[Outcome, list[str]]:
    """Run ``command`` on ``model`` from the seeded and from the empty working directory; the outcome from the
    seeded one and every broken property. ``input_loads``: whether an exit 0 must give outputs ORT loads
    (True: always; None: when ORT loads the input)."""
    if not any(box.cwd.iterdir()):
        seed_cwd(box.cwd, box.model, box.canaries, extra)
    argv = [str(a) for a in COMMANDS[command](model, box.out)]
    before = snapshot(box.root, box.out)
    problems: list[str] = []
    seeded = run_in(box.cwd, argv, box.out, subprocess_run)
    if snapshot(box.root, box.out) != before:
        changed = sorted(set(snapshot(box.root, box.out).items()) ^ set(before.items()))[:3]
        problems.append(f"something outside the output folder changed: {changed}")
        before = snapshot(box.root, box.out)
    problems += _contract(box, model, command, seeded, input_loads)
    problems += leaks(seeded.files, {"stdout": seeded.stdout, "stderr": seeded.stderr}, box.canaries)
    shutil.rmtree(box.out)
    box.out.mkdir()
    empty = run_in(box.empty, argv, box.out, subprocess_run)
    if snapshot(box.root, box.out) != before:
        problems.append("something outside the output folder changed (empty working directory)")
    shutil.rmtree(box.out)
    box.out.mkdir()
    if seeded.normalized() != empty.normalized():
        problems.append(f"outcome depends on the working directory: {_difference(seeded, empty)}")
    return seeded, problems


def _difference(a: Outcome, b: Outcome) -> str:
    na, nb = a.normalized(), b.normalized()
    if na[0] != nb[0]:
        return f"exit {a.code} (seeded cwd) vs {b.code} (empty cwd); stderr {a.stderr.strip()[:200]!r} vs " \
               f"{b.stderr.strip()[:200]!r}"
    for i, what in ((1, "stdout"), (2, "stderr")):
        if na[i] != nb[i]:
            return f"{what} differs: {na[i][:200]!r} vs {nb[i][:200]!r}"
    names = sorted(set(na[3]) | set(nb[3]))
    differ = [n for n in names if na[3].get(n) != nb[3].get(n)]
    return f"output files differ: {differ}"


def _contract(box: Sandbox, model: Path, command: str, outcome: Outcome, input_loads: bool | None) -> list[str]:
    problems = []
    allowed = {0, 1, 2} if command == "check" else {0, 2}
    err = outcome.stderr
    if outcome.code not in allowed:
        problems.append(f"exit {outcome.code}: {err.strip()[:300]!r}")
    if "Traceback" in err:
        problems.append("traceback on stderr")
    if outcome.code == 2:
        if not err.startswith("lnfuse: error:") or len(err.strip().splitlines()) != 1:
            problems.append(f"exit 2 without exactly one error line: {err[:300]!r}")
        if outcome.files:
            problems.append(f"exit 2 left output files: {sorted(outcome.files)}")
    if outcome.code == 0:
        if input_loads is None:
            input_loads = _ort_loads(model, box.empty) is None
        for name in outcome.files:
            if name.endswith(".onnx") and input_loads:
                why = _ort_loads(box.out / name, box.empty)
                if why is not None:
                    problems.append(f"exit 0 but ONNX Runtime does not load {name}: {why}")
    return problems


# ------------------------------------------------------------------------------------------------ attack models

HIDDEN = 8


def _base() -> onnx.ModelProto:
    """A LayerNorm over the last axis of X[3, 2, 8] with gamma and beta initializers."""
    return build(Spec(hidden=HIDDEN))


def _gamma(model: onnx.ModelProto) -> TensorProto:
    return next(t for t in model.graph.initializer if t.name.startswith("gamma"))


def _externalize(tensor: TensorProto, location: str, folder: Path | None, decoy: bool) -> None:
    """Make ``tensor`` external at ``location``; with ``decoy``, write its true bytes there in ``folder``."""
    raw = onh.to_array(tensor).tobytes()
    if decoy and folder is not None:
        path = folder / location
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    onnx.external_data_helper.set_external_data(tensor, location, 0, len(raw))
    for f in ("raw_data", "float_data", "int64_data", "int32_data"):
        tensor.ClearField(f)
    tensor.data_location = TensorProto.EXTERNAL


def _save(model: onnx.ModelProto, folder: Path, data: bytes | None = None) -> Path:
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString() if data is None else data)
    return path


def _location(box: Sandbox, where: str) -> tuple[str, bool]:
    """An external-data location and whether a decoy of that name goes into the model folder."""
    if where == "abs":
        return str(box.secret("id_rsa")), False
    if where == "dotdot":
        box.secret("id_rsa")
        return "../outside/id_rsa", False
    if where == "decoy":
        return "w.data", True  # the cwd gets a canary of the same name
    return where, False       # ".env", ".ssh/id_rsa": only the cwd has one


def sparse_gamma(box: Sandbox, part: str, where: str) -> Path:
    """gamma as a sparse_initializer (all 8 entries given) whose ``part`` (values or indices) is external."""
    model = _base()
    gamma = _gamma(model)
    values = onh.from_array(onh.to_array(gamma), gamma.name)
    indices = onh.from_array(np.arange(HIDDEN, dtype=np.int64), "")
    sparse = oh.make_sparse_tensor(values, indices, [HIDDEN])
    location, decoy = _location(box, where)
    _externalize(sparse.values if part == "values" else sparse.indices, location, box.model, decoy)
    model.graph.initializer.remove(gamma)
    model.graph.sparse_initializer.append(sparse)
    return _save(model, box.model)


def constant_sparse_gamma(box: Sandbox, where: str) -> Path:
    """gamma from a Constant(sparse_value=...) node whose values are external."""
    model = _base()
    gamma = _gamma(model)
    values = onh.from_array(onh.to_array(gamma), "gamma_values")
    sparse = oh.make_sparse_tensor(values, onh.from_array(np.arange(HIDDEN, dtype=np.int64), ""), [HIDDEN])
    location, decoy = _location(box, where)
    _externalize(sparse.values, location, box.model, decoy)
    model.graph.initializer.remove(gamma)
    model.graph.node.insert(0, oh.make_node("Constant", [], [gamma.name], sparse_value=sparse, name="gamma_const"))
    return _save(model, box.model)


def shape_leak(box: Sandbox, dtype: str) -> Path:
    """The norm's output reshaped by a small external Constant: int64 [2] used directly, or int32/uint8 [8] cast
    to int64 (the issue's case). The decoy shape.bin in the model folder holds a valid target, the cwd a canary of
    the same name; the output is declared with symbolic dims, which inference may make concrete."""
    model = _base()
    y = model.graph.output[0]
    if dtype == "int64":
        nodes = [oh.make_node("Constant", [], ["shape"], value=onh.from_array(np.array([6, HIDDEN], np.int64),
                                                                               "shape_value"), name="shape_const")]
    else:
        target = np.array([1, 1, 1, 1, 3, 2, 1, HIDDEN], dtype)
        nodes = [oh.make_node("Constant", [], ["shape_small"], value=onh.from_array(target, "shape_value"),
                              name="shape_const"),
                 oh.make_node("Cast", ["shape_small"], ["shape"], to=TensorProto.INT64, name="shape_cast")]
    _externalize(nodes[0].attribute[0].t, "shape.bin", box.model, True)
    model.graph.node.extend(nodes + [oh.make_node("Reshape", [y.name, "shape"], ["reshaped"], name="reshape")])
    rank = 2 if dtype == "int64" else 8
    model.graph.output.append(oh.make_tensor_value_info("reshaped", TensorProto.FLOAT,
                                                        [f"r{i}" for i in range(rank)]))
    return _save(model, box.model)


def function_gamma(box: Sandbox, decoy: bool) -> Path:
    """gamma computed by a model-local function whose Constant holds it as external data at g.bin."""
    model = _base()
    gamma = _gamma(model)
    const = oh.make_node("Constant", [], ["g"], value=onh.from_array(onh.to_array(gamma), "g_value"))
    _externalize(const.attribute[0].t, "g.bin", box.model, decoy)
    function = oh.make_function("local", "Gamma", [], ["g"], [const], [oh.make_opsetid("", 17)])
    model.functions.append(function)
    model.opset_import.append(oh.make_opsetid("local", 1))
    model.graph.initializer.remove(gamma)
    model.graph.node.insert(0, oh.make_node("Gamma", [], [gamma.name], domain="local", name="gamma_fn"))
    return _save(model, box.model)


def if_gamma(box: Sandbox) -> Path:
    """gamma from If(true): the then-branch is a Constant with external data (decoy g.bin in the model folder)."""
    model = _base()
    gamma = _gamma(model)
    array = onh.to_array(gamma)
    then_const = oh.make_node("Constant", [], ["g_then"], value=onh.from_array(array, "g_then_value"))
    _externalize(then_const.attribute[0].t, "g.bin", box.model, True)
    out = lambda name: oh.make_tensor_value_info(name, TensorProto.FLOAT, [HIDDEN])  # noqa: E731
    then_graph = oh.make_graph([then_const], "then", [], [out("g_then")])
    else_graph = oh.make_graph([oh.make_node("Constant", [], ["g_else"],
                                             value=onh.from_array(array * 0 + 1, "g_else_value"))],
                               "else", [], [out("g_else")])
    model.graph.initializer.remove(gamma)
    model.graph.initializer.append(onh.from_array(np.array(True), "cond"))
    model.graph.node.insert(0, oh.make_node("If", ["cond"], [gamma.name], then_branch=then_graph,
                                            else_branch=else_graph, name="gamma_if"))
    return _save(model, box.model)


def loop_gamma(box: Sandbox) -> Path:
    """gamma carried through a Loop run once, whose body sets it from a Constant with external data."""
    model = _base()
    gamma = _gamma(model)
    array = onh.to_array(gamma)
    body_const = oh.make_node("Constant", [], ["g_body"], value=onh.from_array(array, "g_body_value"))
    _externalize(body_const.attribute[0].t, "g.bin", box.model, True)
    body = oh.make_graph(
        [body_const, oh.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [oh.make_tensor_value_info("i", TensorProto.INT64, []), oh.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         oh.make_tensor_value_info("g_in", TensorProto.FLOAT, [HIDDEN])],
        [oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         oh.make_tensor_value_info("g_body", TensorProto.FLOAT, [HIDDEN])])
    model.graph.initializer.remove(gamma)
    model.graph.initializer.extend([onh.from_array(np.array(1, np.int64), "trips"),
                                    onh.from_array(np.array(True), "go"),
                                    onh.from_array(array * 0 + 1, "g_init")])
    model.graph.node.insert(0, oh.make_node("Loop", ["trips", "go", "g_init"], [gamma.name], body=body,
                                            name="gamma_loop"))
    return _save(model, box.model)


#: a placeholder of the same length as the non-UTF-8 location it stands for in the serialized bytes
_PLACEHOLDER, _NOT_UTF8 = b"wQdata.bin", b"w\xffdata.bin"


def non_utf8_location(box: Sandbox, holder: str) -> Path:
    """An external-data location that is not valid UTF-8 (b'w\\xffdata.bin'), patched into the bytes; a data file
    of exactly that name is in the model folder (the cwd gets a canary of the same name)."""
    model = _base()
    gamma = _gamma(model)
    raw = onh.to_array(gamma).tobytes()
    if holder == "initializer":
        _externalize(gamma, _PLACEHOLDER.decode(), None, False)
    elif holder == "sparse":
        sparse = oh.make_sparse_tensor(onh.from_array(onh.to_array(gamma), gamma.name),
                                       onh.from_array(np.arange(HIDDEN, dtype=np.int64), ""), [HIDDEN])
        _externalize(sparse.values, _PLACEHOLDER.decode(), None, False)
        model.graph.initializer.remove(gamma)
        model.graph.sparse_initializer.append(sparse)
    else:  # a Constant node
        const = oh.make_node("Constant", [], [gamma.name], value=onh.from_array(onh.to_array(gamma), "g_value"),
                             name="gamma_const")
        _externalize(const.attribute[0].t, _PLACEHOLDER.decode(), None, False)
        model.graph.initializer.remove(gamma)
        model.graph.node.insert(0, const)
    (box.model / os.fsdecode(_NOT_UTF8)).write_bytes(raw)
    data = model.SerializeToString()
    assert data.count(_PLACEHOLDER) == 1
    return _save(model, box.model, data.replace(_PLACEHOLDER, _NOT_UTF8))


def main_constant_gamma(box: Sandbox) -> Path:
    """gamma from a main-graph Constant node whose tensor is external data (g.bin, in the model folder); the
    output goes to another folder, so the data must come along (or be inlined)."""
    model = _base()
    gamma = _gamma(model)
    const = oh.make_node("Constant", [], [gamma.name], value=onh.from_array(onh.to_array(gamma), "g_value"),
                         name="gamma_const")
    _externalize(const.attribute[0].t, "g.bin", box.model, True)
    model.graph.initializer.remove(gamma)
    model.graph.node.insert(0, const)
    return _save(model, box.model)


#: attack id -> (builder, extra names for the cwd, whether the model is valid read from its own folder: ORT loads
#: it, so an exit 0 must give outputs ORT loads)
ATTACKS = {
    **{f"sparse_{part}_{where.strip('.').replace('/', '_')}": (
        lambda box, part=part, where=where: sparse_gamma(box, part, where), (), where == "decoy")
       for part in ("values", "indices") for where in (".env", ".ssh/id_rsa", "decoy", "abs", "dotdot")},
    **{f"constant_sparse_value_{where.strip('.').replace('/', '_')}": (
        lambda box, where=where: constant_sparse_gamma(box, where), (), where == "decoy")
       for where in (".env", "decoy", "abs", "dotdot")},
    # ORT's own shape inference cannot read an external Constant feeding Reshape directly: whether the input loads
    # is asked of ORT
    "shape_leak_int64": (lambda box: shape_leak(box, "int64"), (), False),
    "shape_leak_int32_cast": (lambda box: shape_leak(box, "int32"), (), True),
    "shape_leak_uint8_cast": (lambda box: shape_leak(box, "uint8"), (), True),
    "function_constant_decoy": (lambda box: function_gamma(box, True), (), True),
    "function_constant_cwd_only": (lambda box: function_gamma(box, False), (), False),
    "if_branch_constant": (if_gamma, (), True),
    "loop_body_constant": (loop_gamma, (), True),
    **{f"non_utf8_location_{holder}": (lambda box, holder=holder: non_utf8_location(box, holder), (_NOT_UTF8,), False)
       for holder in ("initializer", "sparse", "constant")},
    "main_constant_external": (main_constant_gamma, (), True),
}


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


#: the commands of the issue; --json, --external-data single and decompose --no-verify run on the same models in
#: tests/test_cwd_canary.py's matrix
GATE_COMMANDS = ("fuse", "fuse_no_verify", "fuse_verify_model", "fuse_report_json", "explain", "explain_annotate",
                 "check", "decompose")


@pytest.mark.parametrize("command", GATE_COMMANDS)
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_gate_attack(box: Sandbox, attack: str, command: str):
    builder, extra, valid = ATTACKS[attack]
    model = builder(box)
    folder_before = snapshot(box.model, box.out)
    _outcome, problems = run_both(box, model, command, input_loads=True if valid else None, extra=extra)
    assert snapshot(box.model, box.out) == folder_before, "the model folder changed"
    assert not problems, f"{attack} / {command}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("attack", ["sparse_values_env", "function_constant_decoy"])
def test_gate_attack_through_a_process(box: Sandbox, attack: str):
    """The same through real processes started in the seeded and the empty directory."""
    builder, extra, valid = ATTACKS[attack]
    model = builder(box)
    _outcome, problems = run_both(box, model, "fuse_no_verify", input_loads=True if valid else None, extra=extra,
                                  subprocess_run=True)
    assert not problems, f"{attack}:\n  " + "\n  ".join(problems)


def test_the_attack_models_are_what_they_claim(box: Sandbox):
    """The decoy models are valid from their own folder (ORT runs them from an empty working directory), and the
    canary detector sees canary bytes where a leaking run would put them: in raw data, in declared dims (as int64
    and as uint8 runs), in float_data, and printed."""
    for attack, (builder, _extra, valid) in ATTACKS.items():
        if not valid:
            continue
        sub = Sandbox(box.root / attack)
        path = builder(sub)
        assert _ort_loads(path, sub.empty) is None, attack
    canaries = Canaries()
    blob = canaries.content(64)
    model = _base()
    g = _gamma(model)
    g.raw_data = blob[:32]
    assert leaks({"m.onnx": model.SerializeToString()}, {}, canaries)
    model = _base()
    dims = [int(d) for d in np.frombuffer(blob[:16], np.int64)]
    model.graph.value_info.append(oh.make_tensor_value_info("v", TensorProto.FLOAT, dims))
    found = leaks({"m.onnx": model.SerializeToString()}, {}, canaries)
    assert any("declared shapes" in f for f in found), found
    model = _base()
    dims = [int(d) for d in np.frombuffer(blob[:16], np.int32)]
    model.graph.value_info.append(oh.make_tensor_value_info("v", TensorProto.FLOAT, dims))
    assert any("declared shapes" in f for f in leaks({"m.onnx": model.SerializeToString()}, {}, canaries))
    model = _base()
    model.graph.value_info.append(oh.make_tensor_value_info("v", TensorProto.FLOAT, list(blob[:8])))
    assert any("declared shapes" in f for f in leaks({"m.onnx": model.SerializeToString()}, {}, canaries))
    model = _base()
    g = _gamma(model)
    g.ClearField("raw_data")
    g.float_data.extend(np.frombuffer(blob[:32], np.float32).tolist())
    assert any("tensor values" in f for f in leaks({"m.onnx": model.SerializeToString()}, {}, canaries))
    number = str(int.from_bytes(blob[:8], "little", signed=True))
    assert leaks({}, {"stderr": f"lnfuse: error: dim {number} is too large"}, canaries)
    assert not leaks({"m.onnx": _base().SerializeToString()}, {"stdout": "1234567890123456"}, canaries)
