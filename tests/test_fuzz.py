"""A seeded mutation fuzzer: malformed and hostile variants of real models through the real command line.

Each case takes a seed model (sample exports and small norm graphs). Half the cases mutate it at the byte level
(flips, truncations, insertions, runs of 0xff), the field level (dims, data types, names with invalid UTF-8, op
attributes, sparse tensors, opset imports, graph inputs and outputs, IR version) or its external data (entries, links,
hard links). The other half are structure-aware: weights made sparse (sparse_initializer, Constant sparse_value,
bent shapes and indices), norms moved into model-local functions and If/Loop bodies with their weights as Constants
inside, epsilon or a Reshape target computed from ConstantOfShape/Expand/Range/Tile/Pad of a huge constant size, and
external data on every tensor kind (initializers, sparse values and indices, Constant and attribute tensors in the
main graph, bodies and functions) pointed at the working directory, absolute paths, ``..``, non-UTF-8 names, links,
FIFOs and devices. Every case runs ``lnfuse`` from a working directory of canary files (``.env``, ``.ssh/id_rsa``,
and a file named like every location the model mentions) and checks the contract:

- the exit code is 0 or 2, never a traceback; a failure is one line on stderr, and leaves no output and no stray file;
- the input (the model and its data files) is unchanged, and nothing outside the output folder is created or changed;
- a success writes a model that ONNX Runtime loads whenever it loaded the input;
- no canary byte appears in any output file, in the written model's dims, on stdout or stderr;
- the run stays within the memory budget (``_MEMORY_LIMIT``) and never blocks (``_TIMEOUT``).

A third of the cases attack the write side (issue 27; ``make_write_case``): hostile names (terminal escapes, bidi
controls, forged verdict lines), locations naming the user's files, local functions shadowing standard ops, folder
shapes (links to the folder itself, a fake staging folder, a shipped ledger), run through fuse, ``-v``, explain, check
or a many-model run. Every case also has the user's files in the output folder, which must stay byte-identical, and
what lnfuse prints may hold no control byte and no forged verdict line.

CI runs ``LNFUSE_FUZZ`` cases (default 300); ``LNFUSE_FUZZ=20000 pytest tests/test_fuzz.py`` is a long campaign
(``LNFUSE_FUZZ_FROM=10000`` starts at that case: two processes share one series)
(``LNFUSE_FUZZ_SEED`` picks another series). A failing case prints the case number that reproduces it:
``LNFUSE_FUZZ_CASE=<n> pytest tests/test_fuzz.py -k campaign``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from normgraphs import Spec, build
from onnx import TensorProto

from lnfuse.cli import main

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


# ------------------------------------------------------------------------------------ structure-aware mutations
#
# Each takes (model, rng, notes) and rewrites the model's structure the way a hostile or unusual exporter could:
# norms moved into model-local functions or If/Loop bodies with their weights as Constants inside, weights made
# sparse, epsilon or a Reshape target computed from a huge constant size. ``external_everywhere`` then moves tensors
# of every kind to external data and points some of them at hostile places (see ``_HOSTILE``).

_FN_DOMAIN = "fuzz.local"
_NORM_STARTS = ("ReduceMean", "ReduceSum", "GlobalAveragePool", "LayerNormalization", "SimplifiedLayerNormalization",
                "RMSNormalization", "SkipLayerNormalization")
_HUGE = (2 ** 20, 2 ** 28, 2 ** 31, 2 ** 31 + 1, 2 ** 33, 2 ** 40, 2 ** 62, 0, -1)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - a mutated model may not infer: the declared types are used then
        inferred = model
    g = inferred.graph
    types = {t.name: onnx.helper.make_tensor_type_proto(t.data_type, None) for t in g.initializer}
    types.update((v.name, v.type) for v in list(g.input) + list(g.output) + list(g.value_info))
    return types


def _value(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    """A value_info with the element type only (subgraph and function boundaries need no shapes)."""
    elem = types[name].tensor_type.elem_type if name in types and types[name].HasField("tensor_type") else 0
    return onnx.helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, None)


def _referenced(nodes) -> set[str]:
    """Every name the nodes read, their subgraphs' outer-scope reads included."""
    found = set()
    for node in nodes:
        found.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found |= _referenced(sub.node)
                found.update(o.name for o in sub.output)
    return found


def _region(graph: onnx.GraphProto, rng: random.Random) -> tuple[int, int, list[str], list[str]]:
    """A contiguous run of nodes (a whole norm when one is found) and the names it reads and hands on."""
    nodes = list(graph.node)
    starts = [i for i, node in enumerate(nodes) if node.op_type in _NORM_STARTS]
    if starts and rng.random() < 0.75:
        i = rng.choice(starts)
        j = i + (1 if nodes[i].op_type.endswith("Normalization") else rng.choice([9, 10, 12]))
    else:
        i = rng.randrange(len(nodes))
        j = i + rng.randrange(1, 13)
    j = min(j, len(nodes))
    produced, reads = set(), []
    for node in nodes[i:j]:
        reads += [x for x in node.input if x and x not in produced and x not in reads]
        produced.update(o for o in node.output if o)
    later = _referenced(nodes[j:]) | {o.name for o in graph.output}
    outputs = [o for node in nodes[i:j] for o in node.output if o and o in later]
    if not outputs:
        outputs = [next(o for node in reversed(nodes[i:j]) for o in node.output if o)] if produced else []
    return i, j, reads, outputs


def _drop_unused_initializers(graph: onnx.GraphProto, names: set[str]) -> None:
    used = _referenced(graph.node) | {o.name for o in graph.output}
    gone = {n for n in names if n not in used}
    kept = [t for t in graph.initializer if t.name not in gone]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    inputs = [v for v in graph.input if v.name not in gone]
    graph.ClearField("input")
    graph.input.extend(inputs)


def _constant(name: str, tensor: TensorProto) -> onnx.NodeProto:
    value = TensorProto()
    value.CopyFrom(tensor)
    value.name = name
    return onnx.helper.make_node("Constant", [], [name], value=value, name=f"fz_const_{name}")


def _replace_nodes(graph: onnx.GraphProto, i: int, j: int, new: list[onnx.NodeProto]) -> None:
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(nodes[:i] + new + nodes[j:])


def s_function(model, rng, notes):
    """A norm (or any run of nodes) moved into a model-local function and called; its weights as Constants in it."""
    g = model.graph
    if not g.node:
        return
    i, j, reads, outputs = _region(g, rng)
    if not outputs:
        return
    inits = {t.name: t for t in g.initializer}
    inside = rng.random() < 0.7
    body = [_constant(x, inits[x]) for x in reads if inside and x in inits]
    params = [x for x in reads if not (inside and x in inits)]
    body += [copy_node(n) for n in g.node[i:j]]
    name = rng.choice(["fz_norm", "LayerNormalization", "Add"])  # a local function may shadow a standard op name
    imports = [o for o in model.opset_import if o.domain != _FN_DOMAIN]
    model.functions.append(onnx.helper.make_function(_FN_DOMAIN, name, params, outputs, body, imports))
    _replace_nodes(g, i, j, [onnx.helper.make_node(name, params, outputs, domain=_FN_DOMAIN, name="fz_call")])
    _drop_unused_initializers(g, set(inits))
    if not any(o.domain == _FN_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(_FN_DOMAIN, 1))
    model.ir_version = max(model.ir_version, 8)
    notes.append(f"function {name}({len(params)} params, {j - i} nodes{', constants inside' if inside else ''})")


def copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    new = onnx.NodeProto()
    new.CopyFrom(node)
    return new


def _body(nodes, reads, outputs, inits, inside, suffix, types, loop=False) -> onnx.GraphProto:
    """A subgraph computing ``outputs`` with the region's nodes, every name it defines renamed with ``suffix``."""
    rename, body = {}, []
    for x in reads:
        if inside and x in inits:
            rename[x] = x + suffix + "k"
            body.append(_constant(rename[x], inits[x]))
    for node in nodes:
        new = copy_node(node)
        for k, x in enumerate(new.input):
            new.input[k] = rename.get(x, x)
        for k, o in enumerate(new.output):
            if o:
                rename[o] = new.output[k] = o + suffix
        new.name = (node.name or node.op_type) + suffix
        body.append(new)
    ins, outs = [], [_value(o, types) for o in outputs]
    for o, v in zip(outputs, outs):
        v.name = rename[o]
    if loop:
        ins = [onnx.helper.make_tensor_value_info("fz_iter" + suffix, TensorProto.INT64, []),
               onnx.helper.make_tensor_value_info("fz_cin" + suffix, TensorProto.BOOL, [])]
        body.append(onnx.helper.make_node("Identity", ["fz_cin" + suffix], ["fz_cout" + suffix]))
        outs.insert(0, onnx.helper.make_tensor_value_info("fz_cout" + suffix, TensorProto.BOOL, []))
    return onnx.helper.make_graph(body, "fz_body" + suffix, ins, outs)


def s_subgraph(model, rng, notes):
    """A norm (or run of nodes) wrapped in an If with a constant condition or a Loop of one iteration."""
    g = model.graph
    if not g.node:
        return
    types = _types(model)
    i, j, reads, outputs = _region(g, rng)
    if not outputs:
        return
    inits = {t.name: t for t in g.initializer}
    inside = rng.random() < 0.7
    region = list(g.node[i:j])
    if rng.random() < 0.5:
        cond = rng.random() < 0.8
        new = [onnx.helper.make_node("Constant", [], ["fz_cond"], value=onnx.helper.make_tensor(
                   "fz_cond", TensorProto.BOOL, [], [cond])),
               onnx.helper.make_node("If", ["fz_cond"], outputs, name="fz_if",
                                     then_branch=_body(region, reads, outputs, inits, inside, "__t", types),
                                     else_branch=_body(region, reads, outputs, inits, inside, "__e", types))]
        notes.append(f"If({cond}) around {j - i} nodes{', constants inside' if inside else ''}")
    else:
        body = _body(region, reads, outputs, inits, inside, "__l", types, loop=True)
        trip = onnx.helper.make_tensor("fz_trip", TensorProto.INT64, [], [1])
        new = [onnx.helper.make_node("Constant", [], ["fz_trip"], value=trip),
               onnx.helper.make_node("Loop", ["fz_trip", ""], [o + "__scan" for o in outputs], body=body,
                                     name="fz_loop")]
        if _opset(model) >= 13:
            new.append(onnx.helper.make_node("Constant", [], ["fz_axis0"], value=onnx.helper.make_tensor(
                "fz_axis0", TensorProto.INT64, [1], [0])))
            new += [onnx.helper.make_node("Squeeze", [o + "__scan", "fz_axis0"], [o]) for o in outputs]
        else:
            new += [onnx.helper.make_node("Squeeze", [o + "__scan"], [o], axes=[0]) for o in outputs]
        notes.append(f"Loop(1) around {j - i} nodes{', constants inside' if inside else ''}")
    _replace_nodes(g, i, j, new)
    if inside:
        _drop_unused_initializers(g, set(inits))


def _constant_slots(model):
    """Constant nodes holding a ``value`` tensor, anywhere (main graph, subgraphs, functions)."""
    found = []
    for node in _all_nodes(model) + [n for f in model.functions for n in f.node]:
        if node.op_type == "Constant":
            found += [(node, a) for a in node.attribute if a.name == "value" and a.HasField("t")]
    return found


def s_sparse(model, rng, notes):
    """A used weight made sparse: a sparse_initializer or a Constant sparse_value (main graph, bodies, functions),
    COO indices linear or per-axis, sometimes with a bent shape, indices or values."""
    g = model.graph
    used = _referenced(g.node)
    inits = [t for t in g.initializer if t.name in used and t.data_type in (1, 10, 11, 16)]
    consts = _constant_slots(model)
    if not inits and not consts:
        return
    from_const = bool(consts) and (not inits or rng.random() < 0.4)
    if from_const:
        _node, attr = rng.choice(consts)
        tensor = attr.t
    else:
        tensor = rng.choice(inits)
    try:
        array = onnx.numpy_helper.to_array(tensor)
    except Exception:  # noqa: BLE001
        return
    if array.size > 1 << 20:
        return
    flat = array.reshape(-1).copy()
    if flat.size > 1:
        flat[rng.sample(range(flat.size), flat.size // 2)] = 0
    nz = np.flatnonzero(flat)
    values, dims = flat[nz], list(array.shape)
    indices = nz.astype(np.int64)
    if array.ndim > 1 and rng.random() < 0.5:
        indices = np.stack(np.unravel_index(nz, array.shape), axis=1).astype(np.int64)
    bend = rng.choice(["", "", "", "huge_dims", "extra_dim", "index_out", "unsorted", "duplicate", "short_values",
                       "int32_indices", "all_zero_huge", "rank_mismatch"])
    if bend == "huge_dims":
        dims = [rng.choice(_HUGE[:6])] + dims[1:]
    elif bend == "extra_dim":
        dims = dims + [1]
    elif bend == "index_out" and indices.size:
        indices = indices.copy()
        indices.reshape(-1)[-1] = rng.choice([-1, flat.size, 2 ** 40])
    elif bend == "unsorted" and indices.shape[0] > 1:
        indices = indices[::-1].copy()
    elif bend == "duplicate" and indices.shape[0] > 1:
        indices = indices.copy()
        indices[1] = indices[0]
    elif bend == "short_values" and values.size:
        values = values[:-1]
    elif bend == "int32_indices":
        indices = indices.astype(np.int32)
    elif bend == "all_zero_huge":
        values, indices, dims = values[:0], indices[:0].reshape(0), [rng.choice([2 ** 31, 2 ** 33, 2 ** 40])]
    elif bend == "rank_mismatch" and indices.ndim == 1:
        indices = np.zeros((indices.size, len(dims) + 1), np.int64)
    sparse = onnx.helper.make_sparse_tensor(onnx.numpy_helper.from_array(values, tensor.name),
                                            onnx.numpy_helper.from_array(indices, tensor.name + "_indices"), dims)
    if from_const:
        attr.name, attr.type = "sparse_value", onnx.AttributeProto.SPARSE_TENSOR
        attr.ClearField("t")
        attr.sparse_tensor.CopyFrom(sparse)
        where = "Constant sparse_value (was a Constant)"
    elif rng.random() < 0.5:
        g.node.insert(0, onnx.helper.make_node("Constant", [], [tensor.name], sparse_value=sparse, name="fz_sparse"))
        where = "Constant sparse_value"
    else:
        g.sparse_initializer.append(sparse)
        where = "sparse_initializer"
    if not from_const:
        kept = [t for t in g.initializer if t.name != tensor.name]
        g.ClearField("initializer")
        g.initializer.extend(kept)
        inputs = [v for v in g.input if v.name != tensor.name]
        g.ClearField("input")
        g.input.extend(inputs)
    notes.append(f"sparse {where} {tensor.name!r} dims {dims} nnz {values.size}{' ' + bend if bend else ''}")


def _big(op: str, n: int, value: np.ndarray, rank: int, nodes: list, tag: str, reduce_min: bool) -> str:
    """Nodes computing a tensor of ``n`` (or n x n) copies of ``value`` (shape [1]) with ``op``, then its first
    element (or its minimum: the same number) as a scalar; the scalar's name."""
    def const(name, array):
        nodes.append(onnx.helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(array, name)))
        return name
    sizes = np.array([n] * rank, np.int64)
    out = f"fz_big_{tag}"
    if op == "ConstantOfShape":
        nodes.append(onnx.helper.make_node("ConstantOfShape", [const(f"fz_size_{tag}", sizes)], [out],
                                           value=onnx.numpy_helper.from_array(value.reshape(1), "v")))
    elif op == "Expand":
        nodes.append(onnx.helper.make_node("Expand", [const(f"fz_v_{tag}", value.reshape([1] * rank)),
                                                      const(f"fz_size_{tag}", sizes)], [out]))
    elif op == "Range":
        start = const(f"fz_start_{tag}", value.reshape(()))
        nodes.append(onnx.helper.make_node("Range", [start, const(f"fz_limit_{tag}", (value + n).reshape(())),
                                                     const(f"fz_delta_{tag}", np.ones((), value.dtype))], [out]))
    elif op == "Tile":
        nodes.append(onnx.helper.make_node("Tile", [const(f"fz_v_{tag}", value.reshape([1] * rank)),
                                                    const(f"fz_size_{tag}", sizes)], [out]))
    else:
        pads = np.array([0] * rank + [n] * rank, np.int64)
        nodes.append(onnx.helper.make_node("Pad", [const(f"fz_v_{tag}", value.reshape([1] * rank)),
                                                   const(f"fz_pads_{tag}", pads)], [out], mode="edge"))
    reduced = f"fz_first_{tag}"
    if reduce_min:
        nodes.append(onnx.helper.make_node("ReduceMin", [out], [reduced], keepdims=0))
    else:  # Reshape and Gather: ops a constant folder knows, so that the huge tensor is what it would fold
        nodes.append(onnx.helper.make_node("Reshape", [out, const(f"fz_flat_{tag}", np.array([-1], np.int64))],
                                           [f"fz_flat_{tag}_out"]))
        nodes.append(onnx.helper.make_node("Gather", [f"fz_flat_{tag}_out", const(f"fz_at_{tag}", np.array(0))],
                                           [reduced], axis=0))
    return reduced


def s_size_op(model, rng, notes):
    """Epsilon or a Reshape target computed from a huge constant size: the first element (or the minimum) of a
    ConstantOfShape / Expand / Range / Tile / Pad of the same value, so the model means the same thing if anything
    could evaluate it."""
    g = model.graph
    op, n, rank = rng.choice(["ConstantOfShape", "Expand", "Range", "Tile", "Pad"]), rng.choice(_HUGE), 1
    if op != "Range" and rng.random() < 0.3:
        rank = 2
    reduce_min = rng.random() < 0.3
    constants = {t.name: t for t in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].HasField("t"):
            constants[node.output[0]] = node.attribute[0].t
    eps = [(at, k) for at, node in enumerate(g.node) if node.op_type == "Add" for k, x in enumerate(node.input)
           if x in constants and constants[x].data_type == TensorProto.FLOAT and np.prod(constants[x].dims) == 1]
    reshapes = [at for at, node in enumerate(g.node) if node.op_type == "Reshape" and len(node.input) == 2]
    nodes: list[onnx.NodeProto] = []
    at = 0
    if eps and (not reshapes or rng.random() < 0.5):
        at, k = rng.choice(eps)
        node = g.node[at]
        value = onnx.numpy_helper.to_array(constants[node.input[k]]).astype(np.float32).reshape(1)
        node.input[k] = _big(op, n, value, rank, nodes, "eps", reduce_min)
        target = "epsilon"
    elif reshapes:
        at = rng.choice(reshapes)
        node = g.node[at]
        zero = _big(op, n, np.zeros(1, np.int64), rank, nodes, "shape", reduce_min)
        nodes.append(onnx.helper.make_node("Add", [node.input[1], zero], ["fz_target"]))
        node.input[1] = "fz_target"
        target = "Reshape target"
    else:
        x = next((v.name for v in g.input if v.name not in constants), None)
        if x is None:
            return
        for other in g.node:
            for k, name in enumerate(other.input):
                other.input[k] = "fz_reshaped" if name == x else name
        nodes.append(onnx.helper.make_node("Shape", [x], ["fz_shape_of"]))
        zero = _big(op, n, np.zeros(1, np.int64), rank, nodes, "shape", reduce_min)
        nodes.append(onnx.helper.make_node("Add", ["fz_shape_of", zero], ["fz_target"]))
        nodes.append(onnx.helper.make_node("Reshape", [x, "fz_target"], ["fz_reshaped"], name="fz_reshape"))
        target = "Reshape target (of an input)"
    _replace_nodes(g, at, at, nodes)  # just before the node that reads it
    notes.append(f"{target} from {'ReduceMin' if reduce_min else 'Gather'}({op} of {n}{' x ' + str(n) if rank == 2 else ''})")


_STRUCTURE_MUTATIONS = (s_sparse, s_function, s_subgraph, s_size_op)


# -------------------------------------------------------------------------- external data on every tensor kind

def _tensor_slots(model: onnx.ModelProto) -> list[tuple[TensorProto, str]]:
    """Every TensorProto with where it sits: initializers, sparse values and indices, Constant values and other
    attribute tensors, in the main graph, every subgraph and every function."""
    found = []

    def graph(g, where):
        found.extend((t, f"{where} initializer") for t in g.initializer)
        for s in g.sparse_initializer:
            found.extend([(s.values, f"{where} sparse_initializer values"),
                          (s.indices, f"{where} sparse_initializer indices")])
        nodes(g.node, where)

    def nodes(ns, where):
        for n in ns:
            for a in n.attribute:
                said = f"{where} {n.op_type}.{a.name}"
                found.extend([(a.t, said)] if a.HasField("t") else [])
                found.extend((t, said) for t in a.tensors)
                for s in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors):
                    found.extend([(s.values, said + " values"), (s.indices, said + " indices")])
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    graph(sub, f"{where} {n.op_type} body")

    graph(model.graph, "main")
    for f in model.functions:
        nodes(f.node, f"function {f.name}")
    return found


def _raw(tensor: TensorProto) -> bytes | None:
    if tensor.raw_data:
        return tensor.raw_data
    try:
        return onnx.numpy_helper.to_array(tensor).tobytes()
    except Exception:  # noqa: BLE001
        return None


def _set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    for field in ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data",
                  "raw_data", "external_data"):
        tensor.ClearField(field)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


_DATA_NAMES = ("w.data", "sub/w.data", "x.data")
#: a location that is not valid UTF-8: written as the placeholder, swapped byte for byte after serialization
_PLACEHOLDER, _NON_UTF8 = b"NONUTF8XXXX.data", b"\xff\xfeNONUTF8XX.data"

#: where a tensor's external data may point: a file only the working directory has (a canary), an absolute path (to
#: the canary, into the model folder, a device), ``..``, not UTF-8, links (out, to the canary, inside, a folder
#: link, to /dev/zero and /dev/null), a FIFO, the data file itself a FIFO, a folder, a hard link, bent numbers
_HOSTILE = ("cwd_only", "abs_cwd", "abs_folder", "etc_passwd", "dev_zero", "dotdot_cwd", "dotdot_secret",
            "dotdot_inside", "non_utf8", "link_out", "link_cwd", "link_in", "linkdir", "link_dev_zero",
            "link_dev_null", "fifo", "fifo_wdata", "folder", "hard_link", "numbers")

#: the bends that point at the working directory's canaries (a read relative to it, or through a link or ``..``)
_TOWARD_CANARIES = ("cwd_only", "abs_cwd", "dotdot_cwd", "link_cwd", "linkdir")


def _hostile(kind: str, tensor: TensorProto, folder: Path, rng: random.Random) -> None:
    root = folder.parent
    entries = {e.key: e for e in tensor.external_data}
    location = entries["location"]
    if location.value not in _DATA_NAMES:  # bent already: leave it
        return
    data = folder / location.value

    def link(name, target, is_dir=False):
        if not os.path.lexists(folder / name):
            (folder / name).symlink_to(target, target_is_directory=is_dir)
        location.value = name

    if kind == "cwd_only":
        location.value = "only_in_cwd.data"
    elif kind == "abs_cwd":
        location.value = str(root / "cwd" / rng.choice([".env", location.value]))
    elif kind == "abs_folder":
        location.value = str(data)
    elif kind == "etc_passwd":
        location.value = "/etc/passwd"
    elif kind == "dev_zero":
        location.value = "/dev/zero"
    elif kind == "dotdot_cwd":
        location.value = "../cwd/" + rng.choice([".env", ".ssh/id_rsa", location.value])
    elif kind == "dotdot_secret":
        location.value = "../secret"
    elif kind == "dotdot_inside":
        location.value = "sub/../" + location.value
    elif kind == "non_utf8":
        if data.is_file() and not os.path.lexists(folder / os.fsdecode(_NON_UTF8)):
            shutil.copyfile(data, folder / os.fsdecode(_NON_UTF8))
        location.value = _PLACEHOLDER.decode()
    elif kind == "link_out":
        link("link.data", "../secret")
    elif kind == "link_cwd":
        link("cwdlink.data", root / "cwd" / ".env")
    elif kind == "link_in":
        link("inlink.data", location.value)
    elif kind == "linkdir":
        link("linkdir", "../cwd", is_dir=True)
        location.value = "linkdir/" + location.value
    elif kind == "link_dev_zero":
        link("zero.data", "/dev/zero")
    elif kind == "link_dev_null":
        link("null.data", "/dev/null")
    elif kind == "fifo":
        if not os.path.lexists(folder / "fifo.data"):
            os.mkfifo(folder / "fifo.data")
        location.value = "fifo.data"
    elif kind == "fifo_wdata":
        if data.is_file() and not data.is_symlink():
            data.unlink()
            os.mkfifo(data)
    elif kind == "folder":
        location.value = rng.choice(["sub", "sub/", "."])
    elif kind == "hard_link":
        if data.is_file() and not os.path.lexists(folder / "hard.data"):
            os.link(data, folder / "hard.data")
        location.value = "hard.data"
    else:
        key = rng.choice(["offset", "length"])
        entries[key].value = rng.choice(_NUMBERS + (str(2 ** 62), str(os.path.getsize(data))))


def external_everywhere(model: onnx.ModelProto, folder: Path, rng: random.Random, notes: list[str]) -> None:
    """Move tensors of every kind (at least one of each kind the model has, often all) to data files in the model
    folder, then point one to three of them somewhere hostile."""
    slots = [(t, w) for t, w in _tensor_slots(model)
             if t.data_location != TensorProto.EXTERNAL and t.data_type != TensorProto.STRING]
    if not slots:
        return
    if rng.random() < 0.5:
        chosen = slots
    else:
        kinds = collections.defaultdict(list)
        for slot in slots:
            kinds[slot[1].split(" ", 1)[-1] if not slot[1].startswith("function") else "function"].append(slot)
        chosen = [rng.choice(group) for group in kinds.values()]
        chosen += [s for s in slots if rng.random() < 0.3 and not any(s[0] is c[0] for c in chosen)]
    files: dict[str, bytearray] = {}
    moved = []
    for tensor, where in chosen:
        raw = _raw(tensor)
        if raw is None:
            continue
        name = rng.choice(_DATA_NAMES + ("w.data", "w.data"))
        buf = files.setdefault(name, bytearray())
        buf += b"\0" * (-len(buf) % 16)
        _set_external(tensor, name, len(buf), len(raw))
        buf += raw
        moved.append((tensor, where))
    for name, buf in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(bytes(buf))
    notes.append(f"external: {len(moved)} of {len(slots)} tensors")
    if not moved:
        return
    # main-graph initializers are the path every other test walks: the bends go mostly elsewhere (sparse values and
    # indices, Constants, bodies, functions, attribute tensors), and mostly to where the canaries are
    rare = [m for m in moved if m[1] != "main initializer"]
    for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3])):
        tensor, where = rng.choice(rare if rare and rng.random() < 0.8 else moved)
        kind = rng.choice(_HOSTILE + _TOWARD_CANARIES * 2)
        _hostile(kind, tensor, folder, rng)
        notes.append(f"{kind} on {where} {tensor.name!r}")


def structure_case(model: onnx.ModelProto, folder: Path, rng: random.Random) -> str:
    notes: list[str] = []
    order = {m: k for k, m in enumerate((s_size_op, s_sparse, s_subgraph, s_function))}
    for mutation in sorted(rng.sample(_STRUCTURE_MUTATIONS, rng.choice([1, 1, 2])), key=order.get):
        mutation(model, rng, notes)
    if rng.random() < 0.75:
        external_everywhere(model, folder, rng, notes)
    data = model.SerializeToString()
    if _PLACEHOLDER in data:
        data = data.replace(_PLACEHOLDER, _NON_UTF8)
    (folder / "model.onnx").write_bytes(data)
    return "; ".join(notes)


# ------------------------------------------------------------------------------------ write-side cases (issue 27)
#
# A third kind of case, drawn from a stream of its own (f"write {series} {case}"), so that a case that is not one
# draws exactly the mutant it drew before these existed. Each takes a seed and applies one or two of: hostile
# names (terminal escapes, bidi controls, forged verdict lines, NUL in every kind of model string), locations naming
# files the user has in the output folder, model-local functions shadowing standard ops, and folder shapes (links
# to the folder itself, a fake staging folder, a shipped ledger, nested subfolders). The command is a fuse (quiet,
# --json or -v), explain, check or a many-model run, so that model strings get printed.

#: share of the cases that attack the write side
_WRITE_SIDE = 1 / 3
#: the output's file name in every case (a model may name its data files after it)
_OUT_NAME = "fused.onnx"
#: model strings a terminal would act on: OSC title and clipboard writes, clear screen, a C1 CSI and NEL, bidi
#: overrides, isolates and marks, carriage return, backspace, a line separator, DEL and NUL
_CONTROLS = ("\x1b]0;t\x07", "\x1b]52;c;Zm9v\x07", "\x1b[2J", "\x9b", "\x85", "\u202e", "\u2066", "\u200f", "\r",
             "\b", "\0", "\x7f", "\u2028")
#: verdict lines a model string tries to print on a line of their own; "[fz]" tells them from lnfuse's own lines
_FORGED = ("lnfuse check: 0 candidate(s) left unfused, 0 fusable [fz]", "lnfuse: error: [fz] nothing to do",
           "FUSED   main: LayerNormalization(axis=-1) [fz]", "wrote [fz]")
#: what a printed line may not hold: C0 controls but tab and newline, DEL, C1, bidi controls and marks, line and
#: paragraph separators, and lone surrogates (bytes that were not UTF-8, which a real stdout cannot even encode)
_UNSAFE_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")
#: files a user keeps in a folder lnfuse writes into, and names a model may give its data files to reach them
_USER_FILES = (".git/config", ".bashrc", "notes.txt")
_USER_NAMES = _USER_FILES + (_OUT_NAME, _OUT_NAME + ".data", "lnfuse-ledger.jsonl", "x.onnx.json",
                             "sub/deeper/w.data")
#: standard ops the rules or the clean-ups read: a model-local function of the same name and domain means
#: something else, and ONNX Runtime runs what the model says
_SHADOWED = ("QuantizeLinear", "DequantizeLinear", "Identity", "Cast", "Unsqueeze", "Expand", "Mul", "ReduceMean",
             "LayerNormalization", "SkipLayerNormalization")


@dataclasses.dataclass
class Case:
    """One case's command line and what its run may do."""
    what: str
    argv: list[str]
    isolate: bool
    #: files the run may create or replace (named from what the user named)
    writes: set[Path]
    #: models ONNX Runtime must load after a success, whenever it loaded the input
    outputs: list[Path]
    #: the folder the user writes into, seeded with the user's own files (None: the model's folder)
    out_dir: Path | None
    exits: tuple[int, ...] = (0, 2)
    #: files the run may change even when it fails (a ledger)
    always: set[Path] = dataclasses.field(default_factory=set)
    #: compare what ONNX Runtime computes on the input and on the output
    numeric: bool = False
    #: a failure is exactly one "lnfuse: error:" line on stderr
    one_line: bool = True
    #: a stale <output>.data left by an earlier run (lnfuse's name, not a user file)
    stale_data: bool = False


def _hostile_text(rng: random.Random, base: str) -> str:
    """``base`` with control characters at its start, middle or end, or followed by a forged verdict line."""
    if rng.random() < 0.35:
        return f"{base}\n{rng.choice(_FORGED)}"
    bad = "".join(rng.sample(_CONTROLS, rng.choice([1, 1, 2, 3])))
    at = rng.choice([0, len(base) // 2, len(base)])
    return base[:at] + bad + base[at:]


def _rename_value(model: onnx.ModelProto, old: str, new: str) -> None:
    """Rename a value everywhere the main graph and its bodies name it."""
    g = model.graph
    for v in list(g.input) + list(g.output) + list(g.value_info):
        v.name = new if v.name == old else v.name
    for t in g.initializer:
        t.name = new if t.name == old else t.name
    for node in _all_nodes(model):
        for names in (node.input, node.output):
            for k, x in enumerate(names):
                if x == old:
                    names[k] = new


def w_names(model: onnx.ModelProto, rng: random.Random, notes: list[str]) -> None:
    """Hostile text in one to three kinds of model string: node names (one, or every node of a norm), a value's and
    an initializer's name, the graph's name, doc strings, metadata, an op's domain, a model-local function's name."""
    g = model.graph
    for kind in rng.sample(("node", "nodes", "value", "initializer", "graph", "doc", "metadata", "domain",
                            "function"), rng.choice([1, 2, 3])):
        if kind == "node" and g.node:
            node = rng.choice(g.node)
            node.name = _hostile_text(rng, node.name or node.op_type)
        elif kind == "nodes":
            for node in g.node:
                if node.op_type in _NORM_STARTS + ("Sub", "Pow", "Sqrt", "Div", "Add", "Mul") and rng.random() < 0.5:
                    node.name = _hostile_text(rng, node.name or node.op_type)
        elif kind == "value":
            produced = [o for n in g.node for o in n.output if o]
            if produced:
                old = rng.choice(produced)
                _rename_value(model, old, _hostile_text(rng, old))
        elif kind == "initializer" and g.initializer:
            old = rng.choice(g.initializer).name
            _rename_value(model, old, _hostile_text(rng, old))
        elif kind == "graph":
            g.name = _hostile_text(rng, g.name or "graph")
        elif kind == "doc":
            target = rng.choice([model, g] + list(g.node))
            target.doc_string = _hostile_text(rng, "doc")
        elif kind == "metadata":
            model.metadata_props.add(key=_hostile_text(rng, "key"), value=_hostile_text(rng, "value"))
        elif kind == "domain" and g.node:
            node = rng.choice(g.node)
            node.domain = _hostile_text(rng, node.domain or "ai.onnx")
            model.opset_import.append(onnx.helper.make_opsetid(node.domain, 1))
        elif kind == "function":
            if not model.functions:
                s_function(model, rng, notes)
            for f in model.functions:
                new = _hostile_text(rng, f.name)
                for node in _all_nodes(model):
                    node.op_type = new if (node.op_type, node.domain) == (f.name, f.domain) else node.op_type
                f.name = new
        else:
            continue
        notes.append(f"hostile {kind}")


def _other_body(rng: random.Random, params: list[str], outs: list[str], opset: int) -> tuple[list, str]:
    """Nodes computing something other than the op they are named after: -x, x + x, x + 1, or a + b for an op of
    two inputs (a Mul that adds); the outputs after the first are copies of the first input."""
    x = params[0]
    kinds = ["neg", "double"] + (["plus_one"] if opset >= 15 else []) + (["add_inputs"] if len(params) > 1 else [])
    kind = rng.choice(kinds)
    if kind == "neg":
        body = [onnx.helper.make_node("Neg", [x], [outs[0]])]
    elif kind == "double":
        body = [onnx.helper.make_node("Add", [x, x], [outs[0]])]
    elif kind == "add_inputs":
        body = [onnx.helper.make_node("Add", [x, params[1]], [outs[0]])]
    else:
        one = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "fz_one")
        body = [onnx.helper.make_node("Constant", [], ["fz_one"], value=one),
                onnx.helper.make_node("CastLike", ["fz_one", x], ["fz_one_like"]),
                onnx.helper.make_node("Add", [x, "fz_one_like"], [outs[0]])]
    body += [onnx.helper.make_node("Identity", [x], [o]) for o in outs[1:]]
    return body, kind


def w_domains(model: onnx.ModelProto, rng: random.Random, notes: list[str]) -> None:
    """A model-local function in domain "" or com.microsoft named like a standard op, computing something else:
    either an existing node of that op now names it, or a call of it is put on a float value between its producer
    and its readers."""
    g = model.graph
    opset = _opset(model)
    domain = rng.choice(["", "", "com.microsoft"])
    present = [k for k, n in enumerate(g.node) if n.op_type in _SHADOWED and n.domain in ("", "ai.onnx",
                                                                                           "com.microsoft")]
    if present and rng.random() < 0.7:
        node = g.node[rng.choice(present)]
        node.domain = domain
        how = "replacing"
    else:
        types = _types(model)
        floats = [(k, o) for k, n in enumerate(g.node) for o in n.output
                  if o and o in types and types[o].tensor_type.elem_type in (1, 10)
                  and any(o in m.input for m in g.node)]
        if not floats:
            return
        at, value = rng.choice(floats)
        new_value = value + "_fz_shadowed"
        for other in g.node:
            for k, x in enumerate(other.input):
                other.input[k] = new_value if x == value else x
        # a call the standard op's schema accepts: ONNX Runtime takes a standard op's schema over a local
        # function of its name, so only a function the schema cannot claim is what ORT runs
        op = rng.choice(["Identity", "Cast", "Mul", "ReduceMean"])
        inputs, attributes = [value] * (2 if op == "Mul" else 1), {}
        if op == "Cast":
            attributes["to"] = types[value].tensor_type.elem_type
        elif op == "ReduceMean":
            attributes["keepdims"] = 1
        node = onnx.helper.make_node(op, inputs, [new_value], domain=domain, name="fz_shadow", **attributes)
        g.node.insert(at + 1, node)
        how = "called on " + repr(value)
    params = [f"p{k}" for k in range(max(len(node.input), 1))]
    outs = [f"o{k}" for k in range(len(node.output))]
    body, kind = _other_body(rng, params, outs, opset)
    imports = [onnx.helper.make_opsetid("", opset)]
    function = onnx.helper.make_function(domain, node.op_type, params, outs, body, imports,
                                         attributes=[a.name for a in node.attribute])
    model.functions.append(function)
    if domain and not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    model.ir_version = max(model.ir_version, 8)
    notes.append(f"function {domain or 'ai.onnx'}:{node.op_type} ({kind}) {how}")


def _externalize(model: onnx.ModelProto, folder: Path, rng: random.Random, names: list[str],
                 prefixes: tuple[str, ...] = ("",)) -> list[str]:
    """Move the main graph's initializers (often every tensor) into the files ``names`` of the model folder, each
    location spelled with one of ``prefixes`` (links to the folder itself); the locations used."""
    slots = [(t, w) for t, w in _tensor_slots(model)
             if t.data_location != TensorProto.EXTERNAL and t.data_type != TensorProto.STRING]
    if rng.random() < 0.6:
        slots = [s for s in slots if s[1] == "main initializer"] or slots
    files: dict[str, bytearray] = {}
    used = set()
    for tensor, _ in slots:
        raw = _raw(tensor)
        if raw is None or (len(raw) < 64 and rng.random() < 0.5):
            continue
        name = rng.choice(names)
        buf = files.setdefault(name, bytearray())
        buf += b"\0" * (-len(buf) % 16)
        location = rng.choice(prefixes) + name
        _set_external(tensor, location, len(buf), len(raw))
        buf += raw
        used.add(location)
    for name, buf in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes(buf))
    return sorted(used)


def _ship_ledger(folder: Path, root: Path, rng: random.Random) -> None:
    """A lnfuse-ledger.jsonl in the model folder whose rows claim the model is fused already: its real hash and
    stat key, an output elsewhere (the working directory's .env, a user's file, nowhere), hostile reasons."""
    model = folder / "model.onnx"
    st = model.stat()
    rows = []
    for output in (root / "cwd" / ".env", root / "out" / "notes.txt", root / "out" / "model.onnx", "../../x"):
        rows.append({"bytes_in": st.st_size, "bytes_out": 1, "data_files": [], "exit": 0, "fused": {"Bogus": 1},
                     "identity": 2, "input": str(model), "limits": {"max_memory": None, "timeout": None},
                     "lnfuse": "lnfuse 0.1.0", "model": _hostile_text(rng, "model.onnx"), "options": {},
                     "output": str(output), "reason": _hostile_text(rng, "reason"), "refused": 0, "seconds": 0.1,
                     "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                     "stat": [["", st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]], "status": "fused"})
    import json
    (folder / "lnfuse-ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_write_case(seeds, case: int, root: Path, series: int = SERIES) -> Case:
    """Write a write-side case's input under root/model; return its command and what the run may do."""
    rng = random.Random(f"write {series} {case}")
    rng.random()  # the draw that made it a write-side case
    name, seed = seeds[rng.randrange(len(seeds))]
    model = onnx.ModelProto()
    model.CopyFrom(seed)
    folder, notes = root / "model", []
    kinds = rng.sample(("names", "locations", "domains", "folders"), rng.choice([1, 1, 2]))
    if "domains" in kinds:
        w_domains(model, rng, notes)
    if "names" in kinds:
        w_names(model, rng, notes)
    files, prefixes, shapes = [], ("",), []
    if "locations" in kinds:
        files += rng.sample(_USER_NAMES, rng.choice([1, 2, 3]))
    if "folders" in kinds:
        shapes = rng.sample(("links", "staging", "ledger", "nested"), rng.choice([1, 2]))
        if "links" in shapes:
            for link in ("a0", "a1"):
                (folder / link).symlink_to(".", target_is_directory=True)
            prefixes = ("", "a0/", "a1/", "a0/a1/", "a1/a0/a0/")
        if "staging" in shapes:
            staging = f".{rng.randbytes(6).hex()}.lnfuse-tmp"
            (folder / staging).mkdir()
            (folder / staging / ".lnfuse-owner").write_text("lnfuse staging folder\n")
            files.append(f"{staging}/w.data")
        if "nested" in shapes:
            files += ["sub/deeper/deepest/w.data", "sub/deeper/w.data"]
        files = files or ["w.data"]
        notes.append("folder " + "+".join(shapes))
    if files:
        used = _externalize(model, folder, rng, files, prefixes)
        notes.append(f"locations {used[:6]}")
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    if "ledger" in shapes:
        _ship_ledger(folder, root, rng)
    return _write_command(root, rng, f"case {case}: {name} write: {'; '.join(notes)}", "domains" in kinds,
                          "ledger" in shapes, "staging" in shapes)


def _write_command(root: Path, rng: random.Random, what: str, numeric: bool, ledger: bool, staging: bool) -> Case:
    """The command a write-side case runs: a fuse (into the output folder or the model's own), explain, check, or a
    many-model run with the shipped ledger as its ledger."""
    model, folder = root / "model" / "model.onnx", root / "model"
    out_dir = folder if rng.random() < (0.6 if staging else 0.2) else root / "out"
    out = out_dir / _OUT_NAME
    printing = rng.choice([["-q"], ["--json"], ["-v"], []])
    verify = ["--no-verify"] if rng.random() < 0.6 else []
    pick = rng.random()
    if ledger and pick < 0.15:  # rare: a many-model run starts its workers' server (about 3 s)
        ledger_path = folder / "lnfuse-ledger.jsonl"
        argv = [str(folder), "-o", str(root / "out"), "--jobs", "1", "--ledger", str(ledger_path),
                *rng.choice([["-q"], []])]
        mirrored = root / "out" / "model.onnx"
        writes = {mirrored, Path(f"{mirrored}.data"), ledger_path}
        # a many-model run reports each model on its own: one refused (a data file named like a model) makes it
        # exit 2 with the others written
        return Case(what + " [many]", argv, True, writes, [mirrored], root / "out", exits=(0, 1, 2), always=writes,
                    one_line=False)
    if pick < 0.6:
        argv = [str(model), "-o", str(out), *printing]
        argv += verify
        argv += ["--external-data", "single"] if rng.random() < 0.25 else []
        writes = {out, Path(f"{out}.data")}
        if rng.random() < 0.3:
            report = out_dir / rng.choice(["x.onnx.json", "report.json"])
            argv += ["--report", str(report)]
            writes.add(report)
        return Case(what + " [fuse]", argv, True, writes, [out], out_dir if out_dir != folder else None,
                    numeric=numeric, stale_data=out_dir != folder and rng.random() < 0.25)
    if pick < 0.78:
        argv = ["explain", str(model), *rng.choice([["-v"], ["--json"], []]), *verify]
        writes = set()
        if rng.random() < 0.2:
            annotated = root / "out" / "annotated.onnx"
            argv += ["--annotate", str(annotated)]
            writes |= {annotated, Path(f"{annotated}.data")}
        return Case(what + " [explain]", argv, True, writes, [], root / "out")
    argv = ["check", str(model), *rng.choice([["-v"], ["--json"], []]), *verify]
    return Case(what + " [check]", argv, True, set(), [], root / "out", exits=(0, 1, 2))


def _is_write_case(series: int, case: int) -> bool:
    return random.Random(f"write {series} {case}").random() < _WRITE_SIDE


def draw_case(seeds, case: int, root: Path, series: int = SERIES, structured: bool | None = None) -> Case:
    """Case ``case`` of a series: a write-side case, or (``structured`` given, or not drawn as one) the byte, field,
    external or structure-aware mutant ``make_case`` draws, fused into root/out."""
    if structured is None and _is_write_case(series, case):
        return make_write_case(seeds, case, root, series)
    what, options, isolate = make_case(seeds, case, root, series, structured)
    out = root / "out" / _OUT_NAME
    writes = {out, Path(f"{out}.data")}
    if "--report" in options:
        writes.add(Path(options[options.index("--report") + 1]))
    return Case(what, [str(root / "model" / "model.onnx"), "-o", str(out), *options], isolate, writes, [out],
                root / "out")


# ---------------------------------------------------------------------------------------------------- one case

#: share of the cases that are structure-aware (drawn from their own random stream, so that the other cases of a
#: series are the same mutants as before these existed)
_STRUCTURED = 0.5


def make_case(seeds, case: int, root: Path, series: int = SERIES,
              structured: bool | None = None) -> tuple[str, list[str], bool]:
    """Write case ``case``'s input under root/model; return its description, the command line options and whether
    it is a structure-aware case (run in a forked child: it may block, crash or allocate)."""
    rng = random.Random(series * 1_000_003 + case)
    srng = random.Random(f"structure {series} {case}")
    if structured is None:
        structured = srng.random() < _STRUCTURED
    folder = root / "model"
    if structured:
        name, seed = seeds[srng.randrange(len(seeds))]
        model = onnx.ModelProto()
        model.CopyFrom(seed)
        what = "structure: " + structure_case(model, folder, srng)
        rng = srng
    else:
        name, seed = seeds[rng.randrange(len(seeds))]
        model = onnx.ModelProto()
        model.CopyFrom(seed)
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
    options += ["--json"] if srng.random() < 0.3 else ["-q"]
    return f"case {case}: {name} {what}", options, structured


# ------------------------------------------------------------------------------------- the working-directory canary

#: secrets every user's working directory may hold; each case's working directory also has a file named like every
#: location its model mentions and every file of its model folder, each holding its own canary
_SECRETS = (b".env", b".ssh/id_rsa", b".aws/credentials")


def _mentioned_locations(path: Path) -> dict[bytes, int]:
    """Every external-data location the model names (any tensor kind, anywhere), with the bytes a read needs."""
    data = path.read_bytes()
    found: dict[bytes, int] = {}
    for bad in (_NON_UTF8,):
        if bad in data:
            found[bad] = 0
    try:
        model = onnx.ModelProto.FromString(data.replace(_NON_UTF8, _PLACEHOLDER))
    except Exception:  # noqa: BLE001 - a byte-mutated model: its folder's names and the secrets still get canaries
        return found
    for tensor, _ in _tensor_slots(model):
        entries = {e.key: e.value for e in tensor.external_data}
        if "location" not in entries:
            continue
        try:
            need = int(entries.get("offset", "0")) + int(entries.get("length", "0"))
        except ValueError:
            need = 0
        location = entries["location"].encode("utf-8", "surrogateescape").replace(_PLACEHOLDER, _NON_UTF8)
        found[location] = max(found.get(location, 0), need)
    return found


def _names_to_seed(folder: Path, first: Iterable[bytes]) -> dict[bytes, int]:
    """The file names a seeded folder gets (``first``, every file of the model folder, every location the model
    names), each with the bytes a read of it may need."""
    wanted = {name: 0 for name in first}
    for dirpath, _dirs, files in os.walk(os.fsencode(folder)):
        for file in files:
            relative = os.path.relpath(os.path.join(dirpath, file), os.fsencode(folder))
            if relative != b"model.onnx":
                wanted[relative] = max(wanted.get(relative, 0), os.lstat(os.path.join(dirpath, file)).st_size)
    for location, need in _mentioned_locations(folder / "model.onnx").items():
        wanted[location] = max(wanted.get(location, 0), need)
    return wanted


def _seed_canaries(root: Path, tag: str) -> dict[str, bytes]:
    """Fill root/cwd (and root/secret, the target of links out of the model folder) with canary files; return each
    canary's path (relative to root) and its 8-byte token. A file is its token repeated, at least as long as any
    read the model describes from a file of that name."""
    cwd = root / "cwd"
    wanted = _names_to_seed(root / "model", _SECRETS)
    canaries = {}
    targets = [(os.path.join(os.fsencode(cwd), name), need) for name, need in wanted.items()]
    targets.append((os.fsencode(root / "secret"), 4096))
    for k, (target, need) in enumerate(targets):
        if not target.strip() or b"\0" in target or target.endswith(b"/") or os.path.isabs(target[len(os.fsencode(cwd)) + 1:]):
            continue
        target = os.path.normpath(target)
        inside = os.path.commonpath([target, os.fsencode(root)]) == os.fsencode(root)
        if not inside or any(os.path.commonpath([target, os.fsencode(root / d)]) == os.fsencode(root / d)
                             for d in ("model", "out", "empty")) or target in (os.fsencode(cwd), os.fsencode(root)):
            continue
        token = b"CNY" + hashlib.sha256(f"{tag} {k}".encode()).hexdigest()[:5].encode()
        if _write_canary(target, need, token):
            canaries[os.fsdecode(os.path.relpath(target, os.fsencode(root)))] = token
    return canaries


def _write_canary(target: bytes, need: int, token: bytes) -> bool:
    """Write ``token`` repeated (at least ``need`` bytes) at ``target``; False if no file can be there."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.lexists(target) and not os.path.isfile(target):
            return False
        with open(target, "wb") as f:
            f.write(token * (min(max(need, 4096), 32 << 20) // 8 + 1))
    except OSError:  # a name that cannot be a file here (a parent is a file, too long)
        return False
    return True


def _seed_user_files(root: Path, spec: Case, tag: str) -> dict[str, bytes]:
    """Fill the folder the user writes into with the user's own files: .git/config, .bashrc, notes.txt, and a file
    named like every location the model names and every file of its folder, each holding its own canary; return
    them like ``_seed_canaries``. A name the run writes (the output, ``<output>.data``, the report, the ledger) is
    lnfuse's, not the user's: some cases put a stale ``<output>.data`` there, which the run may replace but whose
    canary must reach nothing else it writes. No user files when the output goes into the model's own folder."""
    if spec.out_dir is None:
        return {}
    base = os.fsencode(spec.out_dir)
    wanted = _names_to_seed(root / "model", [name.encode() for name in _USER_FILES])
    own = {os.fsencode(path) for path in spec.writes | spec.always}
    canaries = {}
    for k, (name, need) in enumerate(sorted(wanted.items())):
        if not name.strip() or b"\0" in name or name.endswith(b"/") or os.path.isabs(name):
            continue
        target = os.path.normpath(os.path.join(base, name))
        if target == base or target in own or os.path.commonpath([target, base]) != base:
            continue
        token = b"USR" + hashlib.sha256(f"{tag} user {k}".encode()).hexdigest()[:5].encode()
        if _write_canary(target, need, token):
            canaries[os.fsdecode(os.path.relpath(target, os.fsencode(root)))] = token
    stale = os.fsencode(spec.out_dir / f"{_OUT_NAME}.data")
    if spec.stale_data and _write_canary(stale, 4096, b"STL" + hashlib.sha256(tag.encode()).hexdigest()[:5].encode()):
        canaries[os.fsdecode(os.path.relpath(stale, os.fsencode(root)))] = Path(os.fsdecode(stale)).read_bytes()[:8]
    return canaries


def _ints_in_model(path: Path) -> set[int]:
    """Every dim and int attribute of a written model (a canary read as a shape shows up there, not as bytes)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001
        return set()
    found: set[int] = set()
    for tensor, _ in _tensor_slots(model):
        found.update(tensor.dims)
    stack = [model.graph] + list(model.functions)
    while stack:
        g = stack.pop()
        for v in list(getattr(g, "input", [])) + list(getattr(g, "output", [])) + list(getattr(g, "value_info", [])):
            if isinstance(v, onnx.ValueInfoProto) and v.type.HasField("tensor_type"):
                found.update(d.dim_value for d in v.type.tensor_type.shape.dim)
        for node in g.node:
            for attr in node.attribute:
                found.update(attr.ints)
                found.add(attr.i)
                stack.extend([attr.g] if attr.HasField("g") else [])
                stack.extend(attr.graphs)
    return found


def _canary_leaks(root: Path, canaries: dict[str, bytes], texts: dict[str, str], files: list[Path]) -> list[str]:
    """Where a canary's bytes (any 8 of them in a row), or 8 of them read as an int64, appear in the files the run
    wrote (models, data, report), in a written model's dims, or on stdout/stderr."""
    patterns, numbers = {}, {}
    for name, token in canaries.items():
        for r in range(8):
            rotated = token[r:] + token[:r]
            patterns[rotated] = name
            numbers[int.from_bytes(rotated, "little", signed=True)] = name
    blobs = {where: text.encode("utf-8", "surrogateescape") for where, text in texts.items()}
    ints: set[int] = set()
    for path in sorted(files):
        if path.is_file() and not path.is_symlink():
            blobs[str(path.relative_to(root))] = path.read_bytes()
            if path.suffix == ".onnx":
                ints |= _ints_in_model(path)
    leaks = []
    for where, blob in blobs.items():
        hit = next((name for pattern, name in patterns.items() if pattern in blob), None)
        hit = hit or next((name for number, name in numbers.items() if str(number).encode() in blob), None)
        if hit:
            leaks.append(f"canary {hit} in {where}")
    leaks += [f"canary {numbers[n]} as a dim or int in the output model" for n in ints & numbers.keys()]
    return leaks


# ----------------------------------------------------------------------------------------------------- running

#: the memory budget of a run on a mutant (docs/security.md, "The fuzz campaign"): the campaign runs under this
#: address-space limit, and each structure-aware case in a forked child under it (every seed is under 400 KB; a run
#: takes about 400 MB of address space and 100-200 MB resident). A mutant that makes some step allocate from a
#: declared size fails that case (MemoryError, exit 3, or a one-line refusal naming the failed allocation: both
#: findings) instead of taking GBs or having the machine's OOM killer end the whole campaign
_MEMORY_LIMIT = 2 << 30
#: a forked run's peak resident memory past this is a finding even when the run ends well: it allocated from a
#: size the model declares (an out-of-memory error some library swallowed looks just like that)
_PEAK_LIMIT = _MEMORY_LIMIT // 2
#: seconds a case may take before it counts as blocked (a FIFO or a device as a data file must never block a run)
_TIMEOUT = float(os.environ.get("LNFUSE_FUZZ_TIMEOUT", "30"))
_OUT_OF_MEMORY = ("bad_alloc", "MemoryError", "Unable to allocate", "out of memory", "Cannot allocate memory",
                  "std::length_error")


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


def _forked(job, timeout: float):
    """Run ``job()`` in a forked child under the memory budget: ("ok", its result, peak RSS in MB), ("timeout",
    None, peak), ("signal N", None, peak) or ("raised", repr, peak)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            with _memory_limited():
                result = ("ok", job())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            result = ("raised", repr(error)[:500])
        try:
            with os.fdopen(w, "wb") as pipe:
                pipe.write(pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline, status = [], time.monotonic() + timeout, "ok"
    with os.fdopen(r, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                status = "timeout"
                break
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, code, usage = os.wait4(pid, 0)
    peak = usage.ru_maxrss / 1024
    if status == "timeout":
        return "timeout", None, peak
    if os.WIFSIGNALED(code) and not chunks:
        return f"signal {os.WTERMSIG(code)}", None, peak
    kind, value = pickle.loads(b"".join(chunks))
    return kind, value, peak


def _call(job, isolate: bool):
    """``_forked(job)``, or ``job()`` in this process (the byte and field cases, which never block: about three
    times faster)."""
    if isolate:
        return _forked(job, _TIMEOUT)
    try:
        return "ok", job(), 0.0
    except BaseException as error:  # noqa: BLE001 - reported like a child's
        return "raised", repr(error)[:500], 0.0


def _ort_loads(path: Path, cwd: Path, isolate: bool = True) -> bool | None:
    """Whether ONNX Runtime loads the model (run from a folder with nothing in it); None if it blocked."""
    def job():
        here = os.getcwd()
        os.chdir(cwd)
        try:
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            return True
        except Exception:  # noqa: BLE001 - any refusal counts as "does not load"
            return False
        finally:
            os.chdir(here)
    status, value, _ = _call(job, isolate)
    return value if status == "ok" else (None if status == "timeout" else False)


def _ort_loads_input(model: Path, cwd: Path, isolate: bool) -> bool:
    """Whether ONNX Runtime loads the (unchanged) input. It blocks on a FIFO as a data file itself: such an input
    counts as one it does not load."""
    special = any(stat.S_ISFIFO(os.lstat(os.path.join(d, f)).st_mode) for d, _, fs in os.walk(model.parent)
                  for f in fs)
    return not special and bool(_ort_loads(model, cwd, isolate))


def _main_in(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    here = os.getcwd()
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def _limit_child():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_LIMIT, resource.getrlimit(resource.RLIMIT_AS)[1]))


def run_case(seeds, case: int, root: Path, subprocess_run: bool = False, series: int = SERIES,
             structured: bool | None = None) -> tuple[str, int, list[str]]:
    """Run one case; its exit code and the properties it broke (empty when it kept the contract)."""
    what, code, broken, _peak = run_case_measured(seeds, case, root, subprocess_run, series, structured)
    return what, code, broken


def run_case_measured(seeds, case: int, root: Path, subprocess_run: bool = False, series: int = SERIES,
                      structured: bool | None = None) -> tuple[str, int, list[str], float]:
    for name in ("model", "out", "cwd", "empty"):
        (root / name).mkdir()
    spec = draw_case(seeds, case, root, series, structured)
    canaries = _seed_canaries(root, f"{series} {case}")
    canaries.update(_seed_user_files(root, spec, f"{series} {case}"))
    model = root / "model" / "model.onnx"
    before = _snapshot(root, None)
    broken, peak, code, stdout, err = [], 0.0, -1, "", ""
    if subprocess_run:
        try:
            proc = subprocess.run([sys.executable, "-m", "lnfuse.cli", *spec.argv], capture_output=True, text=True,
                                  check=False, errors="surrogateescape", timeout=_TIMEOUT, cwd=root / "cwd",
                                  preexec_fn=_limit_child)
            code, stdout, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            broken.append(f"no exit within {_TIMEOUT:.0f} s (blocked)")
    else:
        status, value, peak = _call(lambda: _main_in(spec.argv, root / "cwd"), spec.isolate)
        if status == "ok":
            code, stdout, err = value
        elif status == "timeout":
            broken.append(f"no exit within {_TIMEOUT:.0f} s (blocked)")
        else:
            broken.append(f"the run died: {status} {value or ''}".strip())
    if not broken:
        if code not in spec.exits:
            broken.append(f"exit {code}")
        if "Traceback" in err:
            broken.append("traceback")
        if any(word in err for word in _OUT_OF_MEMORY):
            broken.append(f"over the {_MEMORY_LIMIT >> 30} GiB memory budget (a failed allocation, not a refusal)")
        if peak > _PEAK_LIMIT >> 20:
            broken.append(f"peak RSS {peak:.0f} MB, over {_PEAK_LIMIT >> 20} MB (an allocation from a declared size)")
    broken += _printed_text_problems({"stdout": stdout, "stderr": err})
    failed = code not in (0, 1)
    if failed and spec.one_line and not broken and (not err.startswith("lnfuse: error:")
                                                    or len(err.strip().splitlines()) != 1):
        broken.append(f"stderr is not one error line: {err[:300]!r}")
    after = _snapshot(root, None)
    written = _written(before, after, spec, failed)
    broken += written[1]
    if code == 0:
        # a many-model run that refused the model says so in its table, exit 0
        outputs = [out for out in spec.outputs if out.exists() or spec.one_line]
        broken += _ort_contract(model, outputs, root / "empty", spec.numeric, spec.isolate)
    broken += _canary_leaks(root, canaries, {"stdout": stdout, "stderr": err}, written[0])
    if broken:
        broken.append(f"stderr: {err.strip()[:300]!r}")
    return spec.what, code, broken, peak


def _written(before: dict[str, str], after: dict[str, str], spec: Case, failed: bool) -> tuple[list[Path], list[str]]:
    """The files the run created or changed, and what it broke doing so: every file that was there (the input, the
    user's files in the output folder, the working directory's) must be byte-identical afterwards, but for the
    run's own names; a success may create the output, ``<output>.data`` and the report (and a many-model run its
    mirrored output and ledger), a failure nothing."""
    allowed = {str(p) for p in spec.always} | (set() if failed else {str(p) for p in spec.writes})
    created = sorted(set(after) - set(before))
    changed = sorted(k for k in before if after.get(k) != before[k])
    broken = []
    stray = [k for k in created if k not in allowed]
    if stray:
        where = "after a failure" if failed else "beside the output"
        broken.append(f"files created {where}: {stray[:5]}")
    touched = [k for k in changed if k not in allowed]
    if touched:
        broken.append(f"files changed or removed (the user's, the input's or the working directory's): {touched[:5]}")
    return [Path(k) for k in created + changed if k in after], broken


def _printed_problems_in(where: str, text: str) -> list[str]:
    found = []
    bad = _UNSAFE_TEXT.search(text)
    if bad:
        found.append(f"unescaped {bad.group()!r} on {where}: {text[max(bad.start() - 40, 0):bad.start() + 20]!r}")
    forged = next((line for line in text.split("\n") if line.startswith(_FORGED)), None)
    if forged is not None:
        found.append(f"a forged verdict line on {where}: {forged[:80]!r}")
    return found


def _printed_text_problems(texts: dict[str, str]) -> list[str]:
    """What lnfuse printed may hold no control byte but newline and tab, no bidi control, no line separator, and no
    line a model string forged (a model's text is printed escaped, inside lnfuse's own line)."""
    return [problem for where, text in texts.items() for problem in _printed_problems_in(where, text)]


#: numpy types of ONNX Runtime's input type names, for random inputs
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
              "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


def _ort_contract(model: Path, outputs: list[Path], cwd: Path, numeric: bool, isolate: bool) -> list[str]:
    """Whenever ONNX Runtime loads the input, it loads every output; with ``numeric``, it computes the same on the
    output as on the input, on random inputs (unknown dims 2, integers 0 and 1). One forked child for all of it;
    when that child dies or blocks, each model is loaded on its own to tell which did it."""
    special = any(stat.S_ISFIFO(os.lstat(os.path.join(d, f)).st_mode) for d, _, fs in os.walk(model.parent)
                  for f in fs)
    if special or not outputs:
        return []  # ORT blocks on a FIFO as a data file itself: such an input counts as one it does not load

    def job():
        here = os.getcwd()
        os.chdir(cwd)
        try:
            try:
                a = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
            except Exception:  # noqa: BLE001 - any refusal counts as "does not load"
                return []
            found = []
            for out in outputs:
                try:
                    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
                except Exception:  # noqa: BLE001
                    found.append("ORT loaded the input but not the output")
                    continue
                found += _ort_differs(a, b) if numeric else []
            return found
        finally:
            os.chdir(here)
    status, value, _ = _call(job, isolate)
    if status == "ok":
        return value
    if not _ort_loads_input(model, cwd, isolate):
        return []
    found = []
    for out in outputs:
        loads = _ort_loads(out, cwd, isolate)
        if not loads:
            found.append("ORT loaded the input but not the output" + (" (it blocked)" if loads is None else ""))
        elif numeric:
            found.append(f"comparing the outputs in ORT: {status} {value or ''}".strip())
    return found


def _ort_differs(a: ort.InferenceSession, b: ort.InferenceSession) -> list[str]:
    """What the output's session ``b`` computes differently from the input's ``a``; nothing when ``a`` cannot run
    on random inputs."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in a.get_inputs():
        dtype = _ORT_TYPES.get(i.type)
        if dtype is None:
            return []
        shape = [d if isinstance(d, int) and d >= 0 else 2 for d in i.shape]
        feeds[i.name] = (rng.standard_normal(shape) if np.issubdtype(dtype, np.floating)
                         else rng.integers(0, 2, shape)).astype(dtype)
    try:
        expected = dict(zip([o.name for o in a.get_outputs()], a.run(None, feeds)))
    except Exception:  # noqa: BLE001 - an input ORT cannot run on these inputs: nothing to compare
        return []
    try:
        got = dict(zip([o.name for o in b.get_outputs()], b.run(None, feeds)))
    except Exception as error:  # noqa: BLE001
        return [f"ORT runs the input but not the output: {str(error)[:200]}"]
    found = []
    for name, x in expected.items():
        y = got.get(name)
        tol = 5e-2 if x.dtype == np.float16 else 1e-2
        same_shape = y is not None and x.shape == y.shape
        if same_shape and np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol,
                                      equal_nan=True):
            continue
        worst = float(np.nanmax(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) if same_shape else None
        found.append(f"the output computes something else than the input: {name!r} (shapes {x.shape} "
                     f"{None if y is None else y.shape}, worst difference {worst})")
    return found


def _fingerprint(path: Path) -> str:
    """A file's content hash, or for a large one (the campaign also watches the rest of pytest's temporary folder,
    where other tests leave models of gigabytes) what any write changes: size, modification time and inode."""
    st = path.stat()
    if st.st_size > 1 << 20:
        return f"{st.st_size} {st.st_mtime_ns} {st.st_ino} {st.st_mode:o}"
    return f"{hashlib.sha256(path.read_bytes()).hexdigest()} {st.st_mode:o}"


def _snapshot(root: Path, skip: Path | None) -> dict[str, str]:
    """Every entry under ``root`` but ``skip`` and the test's own home (where lnfuse keeps its key and ONNX Runtime
    its cache)."""
    found = {}
    skipped = {skip, Path(os.environ["HOME"])}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d not in skipped]
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = _fingerprint(path)
            else:
                found[str(path)] = "dir" if path.is_dir() else f"special {path.lstat().st_mode:o}"
    return found


def campaign(seeds, cases, base: Path) -> tuple[collections.Counter, list[str], float, tuple[float, str]]:
    """Exits, failures, seconds and the largest peak RSS (MB) of a forked run with its case."""
    with _memory_limited():
        return _campaign(seeds, cases, base)


def _campaign(seeds, cases, base: Path) -> tuple[collections.Counter, list[str], float, tuple[float, str]]:
    exits, failures, start, top = collections.Counter(), [], time.perf_counter(), (0.0, "")
    for case in cases:
        root = base / f"c{case}"
        root.mkdir()
        what, code, broken, peak = run_case_measured(seeds, case, root)
        exits[code] += 1
        top = max(top, (peak, what))
        if broken:
            failures.append(f"{what} (kept in {root}): {'; '.join(broken)}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return exits, failures, time.perf_counter() - start, top


def _warm_up(seeds) -> None:
    """One real run in this process before any case is forked: each child then starts with lnfuse's (and its
    libraries') lazy imports done instead of paying them per case."""
    with tempfile.TemporaryDirectory() as folder:
        for k, (_name, seed) in enumerate(seeds):
            onnx.save(seed, Path(folder) / f"m{k}.onnx")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                main([str(Path(folder) / f"m{k}.onnx"), "-o", str(Path(folder) / f"o{k}.onnx"), "-q"])


@pytest.fixture(scope="module")
def seeds():
    found = _seeds()
    _warm_up(found)
    return found


def test_fuzz_campaign(seeds, tmp_path_factory):
    """The contract holds on every mutant (set LNFUSE_FUZZ for more cases, LNFUSE_FUZZ_CASE for one)."""
    only = os.environ.get("LNFUSE_FUZZ_CASE")
    first = int(os.environ.get("LNFUSE_FUZZ_FROM", "0"))  # a share of a long series, for one process a core
    cases = [int(only)] if only else range(first, CASES)
    base = tmp_path_factory.mktemp("fuzz")
    outside = _snapshot(base.parent, base)
    exits, failures, seconds, (peak, peak_case) = campaign(seeds, cases, base)
    print(f"\nfuzz: {len(cases)} cases of series {SERIES} in {seconds:.1f} s, exits {dict(sorted(exits.items()))}, "
          f"{len(failures)} failing; largest peak RSS of a forked run {peak:.0f} MB ({peak_case.split(':')[0]})")
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
#: fused outputs made ONNX Runtime refuse the written model; a STRING tensor's length check (exit 3). They are the
#: byte and field mutants those series drew before the structure-aware cases existed.
#: (series, case, structure-aware: pinned to what the campaign drew before the write-side cases). 7/1934: a model-local function named
#: LayerNormalization, which ORT's symbolic inference took for ONNX's op (its output typed like its first input: ORT
#: refused the output); 0/132: a Pad of 2^31 inside a function, which onnx's data propagation expanded (24 GB);
#: 8/210: a Tile of 2^28 in a function's body, expanded the same way when the body was typed (3.7 GB); 8/18781: a
#: Tile by 2^40 of an empty tensor, which numpy's tile grows axis by axis (a 4 TiB intermediate, exit 3); 9/608:
#: constant position ids of no element, which the embedding rule reshaped to test for 0..S-1 (exit 3); 43/837 (as
#: drawn now): a local function ReduceMean in ONNX's domain whose body ORT's inference reads, so a value_info onnx
#: contradicts let ORT load the input, and the output, declaring onnx's truth instead, was refused; 44/2525: Unsqueeze
#: axes stored as a double NaN, which ORT refuses as a type error and lnfuse read as axes (exit 3); 45/2280: a
#: local function com.microsoft::Unsqueeze (x + 1, no unsqueeze), which ORT runs as the function as it registers no
#: such contrib op, typed by ORT's symbolic inference as an Unsqueeze: position ids of the wrong rank reached
#: EmbedLayerNormalization, whose kernel aborted the process; 47/1060: a region input of element type UNDEFINED, which
#: verification sized by its bit width (exit 3): such a region cannot be verified
FOUND = ((2, 3808, False), (2, 2876, False), (3, 14181, False), (3, 12068, False), (4, 19930, False),
         (7, 1934, True), (0, 132, True), (8, 210, True), (8, 18781, True), (9, 608, False), (43, 837, None),
         (44, 2525, None), (45, 2280, None), (47, 1060, None))


@pytest.mark.parametrize("series, case, structured", FOUND)
def test_cases_found_by_campaigns_keep_the_contract(seeds, tmp_path: Path, series: int, case: int,
                                                    structured: bool | None):
    what, _code, broken = run_case(seeds, case, tmp_path, series=series, structured=structured)
    assert not broken, (what, broken)
