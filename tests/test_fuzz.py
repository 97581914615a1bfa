"""A seeded mutation fuzzer: malformed and hostile variants of real models through the real command line.

Each case takes a seed model (sample exports and small norm graphs, some with external data), mutates it at the byte
level (flips, truncations, insertions, runs of 0xff) or the field level (dims, data types, names with invalid UTF-8,
external-data entries, links, op attributes, sparse tensors, opset imports, graph inputs and outputs, IR version),
runs ``lnfuse`` on it in a sandbox folder and checks the contract:

- the exit code is 0 or 2, never a traceback; a failure is one line on stderr, and leaves no output and no stray file;
- the input (the model and its data files) is unchanged, and nothing outside the output folder is created or changed;
- a success writes a model that ONNX Runtime loads whenever it loaded the input.

CI runs ``LNFUSE_FUZZ`` cases (default 300); ``LNFUSE_FUZZ=20000 pytest tests/test_fuzz.py`` is a long campaign
(``LNFUSE_FUZZ_SEED`` picks another series). A failing case prints the case number that reproduces it:
``LNFUSE_FUZZ_CASE=<n> pytest tests/test_fuzz.py -k campaign``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lnfuse.cli import main
from normgraphs import Spec, build

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
CASES = int(os.environ.get("LNFUSE_FUZZ", "300"))
SERIES = int(os.environ.get("LNFUSE_FUZZ_SEED", "0"))
SECRET = b"secret outside the model folder\n" * 8

#: small real exports (fast to fuse) and generated norm graphs covering the rules' shapes
_SAMPLE_SEEDS = ("bert_tiny_dynamo_op18.onnx", "hf_gpt2_dynamo_op18.onnx", "roberta_tiny_legacy_op14.onnx",
                 "bert_embeddings_qdq_op14.onnx")
_SPEC_SEEDS = (Spec(hidden=64), Spec(kind="rms", opset=18, hidden=32), Spec(hidden=16, symbolic=True),
               Spec(dtype="float16", cast_stats=True, hidden=32), Spec(keepdims0=True, eps_node=True, hidden=8))


def _seeds() -> list[tuple[str, onnx.ModelProto]]:
    seeds = [(name, onnx.load(SAMPLES / name)) for name in _SAMPLE_SEEDS]
    return seeds + [(f"spec{i}", build(spec)) for i, spec in enumerate(_SPEC_SEEDS)]


# ---------------------------------------------------------------------------------------------- field mutations

_DIMS = (-1, 0, 1, 7, 2 ** 31, 2 ** 40, -2 ** 40, 2 ** 62)
_DTYPES = (0, 8, 13, 16, 17, 21, 23, 24, 25, 26, 99, 999, -1)
_INTS = (-1, 0, 1, 2, 7, 999, -2 ** 40, 2 ** 62)
_FLOATS = (float("nan"), float("inf"), -1.0, 0.0, 1e30, -1e-30)


def _tensors(model: onnx.ModelProto) -> list[TensorProto]:
    from onnx.external_data_helper import _get_all_tensors
    return list(_get_all_tensors(model))


def _value_infos(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    g = model.graph
    return [v for v in list(g.input) + list(g.output) + list(g.value_info) if v.type.HasField("tensor_type")]


def m_dims(model, rng, case):
    tensors, infos = _tensors(model), _value_infos(model)
    if tensors and (rng.random() < 0.5 or not infos):
        t = rng.choice(tensors)
        if t.dims:
            t.dims[rng.randrange(len(t.dims))] = rng.choice(_DIMS)
        else:
            t.dims.append(rng.choice(_DIMS))
    elif infos:
        shape = rng.choice(infos).type.tensor_type.shape
        if shape.dim:
            dim = shape.dim[rng.randrange(len(shape.dim))]
            if rng.random() < 0.2:
                dim.dim_param = rng.choice(["", "N", "\u00e9", "a b"])
            else:
                dim.dim_value = rng.choice(_DIMS)


def m_dtype(model, rng, case):
    tensors, infos = _tensors(model), _value_infos(model)
    if tensors and rng.random() < 0.5:
        rng.choice(tensors).data_type = rng.choice(_DTYPES)
    elif infos:
        rng.choice(infos).type.tensor_type.elem_type = rng.choice(_DTYPES)


def m_tensor_data(model, rng, case):
    tensors = [t for t in _tensors(model) if t.data_location != TensorProto.EXTERNAL]
    if not tensors:
        return
    t = rng.choice(tensors)
    kind = rng.randrange(5)
    if kind == 0 and t.raw_data:
        t.raw_data = t.raw_data[:rng.randrange(len(t.raw_data))]
    elif kind == 1:
        t.float_data.extend([1.0, 2.0])
    elif kind == 2:
        t.data_location = TensorProto.EXTERNAL
    elif kind == 3:
        t.raw_data += b"\0" * rng.choice([1, 4, 1000])
    else:
        t.segment.begin, t.segment.end = 0, rng.choice([1, 5])


def m_attribute(model, rng, case):
    nodes = [n for n in _all_nodes(model) if n.attribute] or list(model.graph.node)
    if not nodes:
        return
    node = rng.choice(nodes)
    if node.op_type == "Cast" or rng.random() < 0.1:
        node.attribute.append(onnx.helper.make_attribute("to", rng.choice(_DTYPES[:-1] + (2 ** 40,))))
        return
    if not node.attribute or rng.random() < 0.15:
        node.attribute.append(onnx.helper.make_attribute(rng.choice(["axis", "epsilon", "axes", "bogus"]),
                                                         rng.choice([1, -7, 0.5, [0, 99]])))
        return
    attr = rng.choice(node.attribute)
    kind = attr.type
    if rng.random() < 0.15:
        node.attribute.remove(attr)
    elif kind == onnx.AttributeProto.INT:
        attr.i = rng.choice(_INTS)
    elif kind == onnx.AttributeProto.FLOAT:
        attr.f = rng.choice(_FLOATS)
    elif kind == onnx.AttributeProto.INTS:
        attr.ClearField("ints")
        attr.ints.extend(rng.choice(_INTS) for _ in range(rng.randrange(4)))
    elif kind == onnx.AttributeProto.TENSOR:
        attr.t.data_type = rng.choice(_DTYPES) if rng.random() < 0.5 else attr.t.data_type
        attr.t.dims.append(rng.choice(_DIMS))
    else:
        attr.type = rng.choice([0, 1, 2, 7, 99])


def m_sparse(model, rng, case):
    """A sparse initializer (or Constant) replacing a used initializer, with its indices, counts or shape bent."""
    dims = rng.choice([[4], [2, 3], [100_000, 100_000], [0], [2 ** 40], [-3, 2], [8, 8]])
    size = int(np.prod([max(d, 0) for d in dims])) if max(dims) < 2 ** 20 else 4
    nnz = rng.choice([0, 1, 3, min(size, 5)])
    values = np.arange(nnz, dtype=np.float32) + 1
    kind = rng.randrange(4)
    if kind == 0:
        indices = np.array(rng.sample(range(max(size, nnz)), nnz) if size >= nnz else list(range(nnz)), np.int64)
    elif kind == 1:
        indices = np.array([rng.choice([-1, size, 2 ** 40]) for _ in range(max(nnz, 1))], np.int64)
    elif kind == 2:
        indices = np.zeros((nnz, len(dims) + rng.choice([0, 1])), np.int64)
    else:
        indices = np.arange(nnz + 1, dtype=np.int64)
    used = [t for t in model.graph.initializer if any(t.name in n.input for n in model.graph.node)]
    name = rng.choice(used).name if used and rng.random() < 0.7 else "sparse_extra"
    sparse = onnx.helper.make_sparse_tensor(onnx.numpy_helper.from_array(values, name),
                                            onnx.numpy_helper.from_array(indices, ""), dims)
    if rng.random() < 0.3:
        sparse.values.data_type = rng.choice(_DTYPES)
    if rng.random() < 0.3:
        model.graph.node.insert(0, onnx.helper.make_node("Constant", [], [name + "_c"], sparse_value=sparse))
        return
    kept = [t for t in model.graph.initializer if t.name != name]
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(kept)
    model.graph.sparse_initializer.append(sparse)


def m_opset(model, rng, case):
    kind = rng.randrange(5)
    imports = model.opset_import
    if kind == 0 and imports:
        rng.choice(imports).version = rng.choice([0, -1, 1, 6, 25, 999, 2 ** 40])
    elif kind == 1:
        model.ClearField("opset_import")
    elif kind == 2:
        imports.append(onnx.helper.make_opsetid(rng.choice(["", "ai.onnx", "com.microsoft", "x"]),
                                                rng.choice([1, 17, 999])))
    elif kind == 3 and imports:
        rng.choice(imports).domain = rng.choice(["ai.onnx", "com.microsoft", "bogus", ""])
    else:
        model.ir_version = rng.choice([0, 1, 3, 7, 11, 13, 14, 99, -1])


def m_graph(model, rng, case):
    g = model.graph
    kind = rng.randrange(8)
    if kind == 0:
        g.ClearField("output")
    elif kind == 1 and g.input:
        del g.input[rng.randrange(len(g.input))]
    elif kind == 2 and g.output:
        g.output[rng.randrange(len(g.output))].name = rng.choice(["", "nowhere", g.node[0].output[0] if g.node
                                                                  else "x"])
    elif kind == 3 and g.node:
        node = rng.choice(g.node)
        if node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(["", "undefined", node.output[0]])
    elif kind == 4 and g.node:
        del g.node[rng.randrange(len(g.node))]
    elif kind == 5 and g.node:
        g.node.append(g.node[rng.randrange(len(g.node))])
    elif kind == 6 and g.node:
        node = rng.choice(g.node)
        node.op_type, node.domain = rng.choice([("LayerNormalization", "com.microsoft"), ("Bogus", ""),
                                                ("SkipLayerNormalization", ""), (node.op_type, "weird")])
    elif g.initializer:
        g.initializer.append(g.initializer[rng.randrange(len(g.initializer))])


def m_value_info(model, rng, case):
    """A value_info claim that may disagree with what the graph computes."""
    g = model.graph
    produced = [o for n in g.node for o in n.output if o]
    if not produced:
        return
    info = onnx.helper.make_tensor_value_info(rng.choice(produced), rng.choice([1, 10, 7, 999]),
                                              [rng.choice(_DIMS + ("N",)) for _ in range(rng.randrange(4))])
    g.value_info.append(info)


_FIELD_MUTATIONS = (m_dims, m_dtype, m_tensor_data, m_attribute, m_sparse, m_opset, m_graph, m_value_info)


def _all_nodes(model: onnx.ModelProto):
    stack, found = [model.graph], []
    while stack:
        g = stack.pop()
        for node in g.node:
            found.append(node)
            for attr in node.attribute:
                stack.extend([attr.g] if attr.HasField("g") else [])
                stack.extend(attr.graphs)
    return found


def bad_utf8(data: bytes, model: onnx.ModelProto, rng: random.Random) -> bytes:
    """One name's first byte made invalid UTF-8, in place (same length, so the wire format stays valid)."""
    names = [n for node in _all_nodes(model) for n in list(node.input) + list(node.output) + [node.name, node.op_type]]
    names += [t.name for t in model.graph.initializer] + [v.name for v in model.graph.input]
    names = [n.encode() for n in names if len(n.encode()) >= 2]
    if not names:
        return data
    name = rng.choice(names)
    at = data.find(name, rng.randrange(max(len(data) - len(name), 1)))
    at = data.find(name) if at < 0 else at
    return data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed", b"\x80"]) + data[at + 1:]


# ----------------------------------------------------------------------------------------------- byte mutations

def byte_mutation(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(7)
    at = rng.randrange(len(buf))
    if kind == 0:
        for _ in range(rng.randrange(1, 9)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        del buf[at:]
    elif kind == 2:
        buf[at:at] = rng.randbytes(rng.randrange(1, 64))
    elif kind == 3:
        del buf[at:at + rng.randrange(1, 256)]
    elif kind == 4:
        buf[at:at] = buf[at:at + rng.randrange(1, 512)]
    elif kind == 5:
        buf[at:at + rng.randrange(1, 4096)] = b"\xff" * rng.randrange(1, 4096)
    else:
        buf[at] = rng.randrange(256)
    return bytes(buf)


# -------------------------------------------------------------------------------------------- external data cases

_LOCATIONS = ("../secret", "/etc/passwd", "w.data\0x", "link.data", "sub/w.data", "linkdir/w.data", "hard.data",
              "./w.data", "w.data/", "missing.data", "", ".", "sub/../w.data", "w.data\n")
_NUMBERS = ("-1", "abc", "1e3", " 4", "0x10", "99999999999999999999", "0", "1", "3")


def external_case(model: onnx.ModelProto, folder: Path, rng: random.Random) -> None:
    """Move the seed's initializers to w.data, then bend one tensor's entry or the folder's files."""
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.data", size_threshold=rng.choice([0, 64, 1024]))
    if not (folder / "w.data").exists():
        (folder / "w.data").write_bytes(SECRET)  # nothing was large enough to move: a data file all the same
    (folder / "sub").mkdir()
    shutil.copyfile(folder / "w.data", folder / "sub" / "w.data")
    (folder / "link.data").symlink_to(folder.parent / "secret")
    (folder / "linkdir").symlink_to(folder.parent, target_is_directory=True)
    proto = onnx.load(folder / "model.onnx", load_external_data=False)
    external = [t for t in _tensors(proto) if t.data_location == TensorProto.EXTERNAL]
    kind = rng.randrange(4)
    if external and kind < 3:
        t = rng.choice(external)
        key = ("location", "offset", "length")[kind]
        entries = {e.key: e for e in t.external_data}
        value = rng.choice(_LOCATIONS) if key == "location" else rng.choice(_NUMBERS)
        if key in entries:
            entries[key].value = value
        else:
            t.external_data.add(key=key, value=value)
    elif kind == 3:
        os.link(folder / "w.data", folder / "hard.data")
        if rng.random() < 0.5:
            (folder / "hard.data").unlink()
            (folder / "w.data").unlink()
            (folder / "w.data").symlink_to(folder.parent / "secret")
    (folder / "model.onnx").write_bytes(proto.SerializeToString())


# ---------------------------------------------------------------------------------------------------- one case

def make_case(seeds, case: int, root: Path, series: int = SERIES) -> tuple[str, list[str]]:
    """Write case ``case``'s input under root/model; return its description and the command line options."""
    rng = random.Random(series * 1_000_003 + case)
    name, seed = seeds[rng.randrange(len(seeds))]
    model = onnx.ModelProto()
    model.CopyFrom(seed)
    folder = root / "model"
    kind = rng.choice(["byte", "field", "field", "utf8", "external"])
    what = kind
    if kind == "external":
        external_case(model, folder, rng)
    else:
        if kind == "field":
            mutation = rng.choice(_FIELD_MUTATIONS)
            what = mutation.__name__
            mutation(model, rng, case)
        data = model.SerializeToString()
        if kind == "byte":
            data = byte_mutation(data, rng)
        elif kind == "utf8":
            data = bad_utf8(data, model, rng)
        (folder / "model.onnx").write_bytes(data)
    options = []
    options += ["--no-verify"] if rng.random() < 0.6 else []
    options += ["--target", "onnx"] if rng.random() < 0.3 else []
    options += ["--external-data", "single"] if rng.random() < 0.2 else []
    options += ["--report", str(root / "out" / "report.json")] if rng.random() < 0.3 else []
    return f"case {case}: {name} {what}", options


def _snapshot(root: Path, skip: Path) -> dict[str, str]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d != skip]
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                st = path.stat()
                found[str(path)] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {st.st_mode:o}"
            else:
                found[str(path)] = "dir"
    return found


def _ort_loads(path: Path) -> bool:
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return True
    except Exception:  # noqa: BLE001 - any refusal counts as "does not load"
        return False


def run_case(seeds, case: int, root: Path, subprocess_run: bool = False,
             series: int = SERIES) -> tuple[str, int, list[str]]:
    """Run one case; its exit code and the properties it broke (empty when it kept the contract)."""
    for name in ("model", "out", "cwd"):
        (root / name).mkdir()
    (root / "secret").write_bytes(SECRET)
    what, options = make_case(seeds, case, root, series)
    model, out = root / "model" / "model.onnx", root / "out" / "fused.onnx"
    loaded_before = _ort_loads(model)
    before = _snapshot(root, root / "out")
    argv = [str(model), "-o", str(out), "-q", *options]
    if subprocess_run:
        proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", *argv], capture_output=True, text=True,
                              timeout=600, cwd=root / "cwd")
        code, err = proc.returncode, proc.stderr
    else:
        err_stream = io.StringIO()
        cwd = os.getcwd()
        os.chdir(root / "cwd")
        try:
            with contextlib.redirect_stderr(err_stream), contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
        finally:
            os.chdir(cwd)
        err = err_stream.getvalue()
    broken = []
    if code not in (0, 2):
        broken.append(f"exit {code}")
    if "Traceback" in err:
        broken.append("traceback")
    if code != 0:
        if not err.startswith("lnfuse: error:") or len(err.strip().splitlines()) != 1:
            broken.append(f"stderr is not one error line: {err[:300]!r}")
        if list((root / "out").iterdir()):
            broken.append(f"output left after a failure: {[p.name for p in (root / 'out').iterdir()]}")
    elif loaded_before and not _ort_loads(out):
        broken.append("ORT loaded the input but not the output")
    if _snapshot(root, root / "out") != before:
        broken.append("something outside the output folder was created or changed")
    if broken:
        broken.append(f"stderr: {err.strip()[:300]!r}")
    return what, code, broken


#: address space for the campaign: a mutant that makes some step allocate from a declared size fails that case
#: (MemoryError, exit 3: a finding) instead of having the machine's OOM killer end the whole run
_MEMORY_LIMIT = 8 << 30


@contextlib.contextmanager
def _memory_limited():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(_MEMORY_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def campaign(seeds, cases, base: Path) -> tuple[collections.Counter, list[str], float]:
    with _memory_limited():
        return _campaign(seeds, cases, base)


def _campaign(seeds, cases, base: Path) -> tuple[collections.Counter, list[str], float]:
    exits, failures, start = collections.Counter(), [], time.perf_counter()
    for case in cases:
        root = base / f"c{case}"
        root.mkdir()
        what, code, broken = run_case(seeds, case, root)
        exits[code] += 1
        if broken:
            failures.append(f"{what} (kept in {root}): {'; '.join(broken)}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return exits, failures, time.perf_counter() - start


@pytest.fixture(scope="module")
def seeds():
    return _seeds()


def test_fuzz_campaign(seeds, tmp_path_factory):
    """The contract holds on every mutant (set LNFUSE_FUZZ for more cases, LNFUSE_FUZZ_CASE for one)."""
    only = os.environ.get("LNFUSE_FUZZ_CASE")
    cases = [int(only)] if only else range(CASES)
    base = tmp_path_factory.mktemp("fuzz")
    outside = _snapshot(base.parent, base)
    exits, failures, seconds = campaign(seeds, cases, base)
    print(f"\nfuzz: {len(cases)} cases in {seconds:.1f} s, exits {dict(sorted(exits.items()))}, "
          f"{len(failures)} failing")
    if os.environ.get("LNFUSE_FUZZ_LOG"):
        Path(os.environ["LNFUSE_FUZZ_LOG"]).write_text("\n".join(failures) + "\n")
    assert _snapshot(base.parent, base) == outside, "a case wrote beside the sandbox"
    assert not failures, "\n".join(failures[:20])


def test_fuzz_cases_through_the_process(seeds, tmp_path: Path):
    """A few cases as real processes: the same exit code and contract as in-process main()."""
    for case in (3, 11, 42, 77):
        a, b = tmp_path / f"in{case}", tmp_path / f"proc{case}"
        a.mkdir(), b.mkdir()
        what, code, broken = run_case(seeds, case, a)
        _, proc_code, proc_broken = run_case(seeds, case, b, subprocess_run=True)
        assert not broken and not proc_broken, (what, broken, proc_broken)
        assert code == proc_code, what


#: (series, case) of mutants that long campaigns found broken, kept as regressions once fixed: ReduceMean axes
#: outside the input's rank reached the channels-first check (exit 3); a declared 0 or 2**62 dim typed into the
#: fused outputs made ONNX Runtime refuse the written model; a STRING tensor's length check (exit 3)
FOUND = ((2, 3808), (2, 2876), (3, 14181), (3, 12068), (4, 19930))


@pytest.mark.parametrize("series, case", FOUND)
def test_cases_found_by_campaigns_keep_the_contract(seeds, tmp_path: Path, series: int, case: int):
    what, _code, broken = run_case(seeds, case, tmp_path, series=series)
    assert not broken, (what, broken)
