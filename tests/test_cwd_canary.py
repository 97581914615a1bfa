"""The working directory never changes an outcome, and nothing of it reaches an output (issue 19).

A fixture seeds a working directory with canary files: one named like every data file of the model's folder (same
size), every common secret (``.env``, ``.ssh/id_rsa``, ``.aws/credentials``, ``id_rsa``, ``secret.bin``) and every
string the model mentions (external-data locations, tensor, node, value, graph and function names, collected from
the proto), each holding a unique canary byte string. Each command runs from it and from an empty directory
(``main()`` in this process after a chdir that is always undone; a few as real processes started there), and:

- no canary byte appears anywhere: output model, data files, report, annotated copy, JSON or tables on stdout,
  stderr, the written models' declared shapes and decoded tensor values;
- the outcome is the same: exit code, stdout and stderr, every output file's bytes (run times in reports and
  summaries are the only thing ignored);
- the usual contract: exit 0 (or 1 for ``check``) or 2 with one line; nothing outside the output folder changes.

Models: equivalents of tests/test_security.py's models, the fuzzer's seed models and a few of its external-data
cases, and a sample of sample_models/ (one also with its weights moved to external data). The gate-attack models of
issue 19 run through the same fixture in tests/test_gate_attacks.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import set_external_data

from normgraphs import Spec, build
from test_gate_attacks import (ATTACKS, COMMANDS, GATE_COMMANDS, Sandbox, leaks, run_both, run_in, seed_cwd,
                               snapshot, working_directory)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    """root/model (the model folder), root/cwd (seeded with canaries once the model is there: ``run_both`` seeds
    it), root/empty, root/outside, root/out."""
    return Sandbox(tmp_path)


@pytest.fixture
def restore_cwd():
    """Whatever a test does, the working directory is the one it started in."""
    before = os.getcwd()
    yield
    assert os.getcwd() == before, "a command left the working directory changed"
    os.chdir(before)


# ------------------------------------------------------------------------------------------- models of the tests

def _external_gamma(folder: Path, location: str = "w.data", write_at: str = "w.data") -> Path:
    """tests/test_security.py's model: a LayerNorm whose gamma (64 floats) is external data at ``location``."""
    model = build(Spec(hidden=64))
    gamma = next(t for t in model.graph.initializer if t.name.startswith("gamma"))
    raw = onnx.numpy_helper.to_array(gamma).tobytes()
    (folder / write_at).parent.mkdir(parents=True, exist_ok=True)
    (folder / write_at).write_bytes(raw)
    set_external_data(gamma, location, 0, len(raw))
    gamma.ClearField("raw_data")
    gamma.ClearField("float_data")
    gamma.data_location = onnx.TensorProto.EXTERNAL
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _security_model(box: Sandbox, case: str) -> Path:
    model = box.model
    if case == "same_folder":
        return _external_gamma(model)
    if case == "subfolder":
        return _external_gamma(model, "weights/w.data", "weights/w.data")
    if case == "alias_inside":
        (model / "weights").mkdir()
        (model / "alias").symlink_to(model / "weights", target_is_directory=True)
        return _external_gamma(model, "alias/w.data", "weights/w.data")
    if case == "dotdot":
        box.secret("id_rsa")
        return _external_gamma(model, "../outside/id_rsa")
    if case == "absolute":
        return _external_gamma(model, str(box.secret("id_rsa", 256)))
    if case == "symlinked_file":
        (model / "key.data").symlink_to(box.secret("id_rsa", 256))
        return _external_gamma(model, "key.data")
    if case == "hard_link":
        path = _external_gamma(model)
        os.link(model / "w.data", box.outside / "other-name")
        return path
    if case == "missing":  # the data file exists only where the working directory is
        path = _external_gamma(model)
        (model / "w.data").unlink()
        return path
    if case == "sparse_inline":
        m = build(Spec(hidden=64))
        gamma = next(t for t in m.graph.initializer if t.name.startswith("gamma"))
        values = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(gamma), gamma.name)
        sparse = onnx.helper.make_sparse_tensor(values, onnx.numpy_helper.from_array(np.arange(64), ""), [64])
        m.graph.initializer.remove(gamma)
        m.graph.sparse_initializer.append(sparse)
        (model / "model.onnx").write_bytes(m.SerializeToString())
        return model / "model.onnx"
    raise AssertionError(case)


SECURITY_CASES = ("same_folder", "subfolder", "alias_inside", "dotdot", "absolute", "symlinked_file", "hard_link",
                  "missing", "sparse_inline")
#: every command on the small models (each run takes milliseconds)
ALL = tuple(COMMANDS)


@pytest.mark.parametrize("command", ALL)
@pytest.mark.parametrize("case", SECURITY_CASES)
def test_security_models(box: Sandbox, restore_cwd, case: str, command: str):
    path = _security_model(box, case)
    folder = snapshot(box.model, box.out)
    _outcome, problems = run_both(box, path, command, input_loads=None)
    assert snapshot(box.model, box.out) == folder, "the model folder changed"
    assert not problems, f"{case} / {command}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------------------------------------- fuzzer seeds

def _fuzz():
    import test_fuzz
    return test_fuzz


_SPEC_SEEDS = [f"spec{i}" for i in range(5)]
#: fuzz cases (series 0) whose model folder has external data, links or hard links: their folders hold data files,
#: so the cwd holds same-named canaries (checked to be "external" cases in the test)
_FUZZ_CASES = (1, 2, 13)


@pytest.fixture(scope="module")
def fuzz_seeds():
    return dict(_fuzz()._seeds())


@pytest.mark.parametrize("command", ("fuse", "fuse_no_verify", "explain_annotate", "check", "decompose"))
@pytest.mark.parametrize("seed", _SPEC_SEEDS)
def test_fuzz_spec_seeds(box: Sandbox, restore_cwd, fuzz_seeds, seed: str, command: str):
    """The fuzzer's generated seeds, with their weights as external data in the model folder."""
    onnx.save(fuzz_seeds[seed], box.model / "model.onnx", save_as_external_data=True, location="w.data",
              size_threshold=0)
    _outcome, problems = run_both(box, box.model / "model.onnx", command, input_loads=True)
    assert not problems, f"{seed} / {command}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("command", ("fuse", "fuse_no_verify"))
@pytest.mark.parametrize("seed", _fuzz()._SAMPLE_SEEDS)
def test_fuzz_sample_seeds(box: Sandbox, restore_cwd, fuzz_seeds, seed: str, command: str):
    onnx.save(fuzz_seeds[seed], box.model / "model.onnx")
    _outcome, problems = run_both(box, box.model / "model.onnx", command, input_loads=True)
    assert not problems, f"{seed} / {command}:\n  " + "\n  ".join(problems)


def _find_external_cases(fuzz, seeds, scratch: Path, wanted: int) -> list[int]:
    """The first fuzz cases of series 0 that are external-data cases (their folder holds data files and links), as
    the fuzzer itself draws them (its original, not structure-aware, half)."""
    found = []
    for case in range(400):
        root = scratch / f"probe{case}"
        (root / "model").mkdir(parents=True)
        what, _, _ = fuzz.make_case(seeds, case, root, 0, structured=False)
        shutil.rmtree(root)
        if "external" in what:
            found.append(case)
        if len(found) == wanted:
            break
    return found


def test_fuzz_external_cases(tmp_path: Path, restore_cwd, fuzz_seeds):
    """A few of the fuzzer's external-data cases (links, hard links, bent locations, offsets), each as the fuzzer
    runs it (its options), from a seeded and an empty working directory."""
    fuzz = _fuzz()
    seeds = list(fuzz_seeds.items())
    cases = _find_external_cases(fuzz, seeds, tmp_path, 4)
    assert len(cases) == 4
    failures = []
    for case in cases:
        box = Sandbox(tmp_path / f"c{case}")
        (box.root / "secret").write_bytes(box.canaries.content(256))
        what, options, _ = fuzz.make_case(seeds, case, box.root, 0, structured=False)
        assert "external" in what, what
        model = box.model / "model.onnx"
        seed_cwd(box.cwd, box.model, box.canaries)
        options = [o.replace(str(box.root / "out"), str(box.out)) for o in options]
        argv = [str(model), "-o", str(box.out / "fused.onnx"), *options]
        before = snapshot(box.root, box.out)
        seeded = run_in(box.cwd, argv, box.out)
        found = leaks(seeded.files, {"stdout": seeded.stdout, "stderr": seeded.stderr}, box.canaries)
        shutil.rmtree(box.out)
        box.out.mkdir()
        empty = run_in(box.empty, argv, box.out)
        shutil.rmtree(box.out)
        box.out.mkdir()
        if snapshot(box.root, box.out) != before:
            found.append("something outside the output folder changed")
        if seeded.code not in (0, 2):
            found.append(f"exit {seeded.code}: {seeded.stderr.strip()[:200]}")
        if seeded.normalized() != empty.normalized():
            found.append(f"exit {seeded.code} (seeded) vs {empty.code} (empty): {seeded.stderr.strip()[:150]!r} vs "
                         f"{empty.stderr.strip()[:150]!r}")
        failures += [f"{what}: {f}" for f in found]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------ sample models

#: small real exports of different exporters (a few seconds each for all their commands)
SAMPLE = ("sam_neck_legacy_op17.onnx", "keras_encoder_tf2onnx_op17.onnx", "llama_tiny_fp16_legacy_op17.onnx",
          "bert_embeddings_qdq_op14.onnx")


@pytest.mark.parametrize("command", ("fuse", "fuse_no_verify", "explain_json", "decompose"))
@pytest.mark.parametrize("sample", SAMPLE)
def test_sample_models(box: Sandbox, restore_cwd, sample: str, command: str):
    shutil.copyfile(SAMPLES / sample, box.model / sample)
    _outcome, problems = run_both(box, box.model / sample, command, input_loads=True)
    assert not problems, f"{sample} / {command}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("command", ("fuse", "fuse_no_verify", "fuse_single_onnx", "explain_annotate"))
def test_sample_model_with_external_data(box: Sandbox, restore_cwd, command: str):
    """A real export whose weights are external (one file per tensor, named after the tensors): the cwd holds a
    canary of each data file's name and size."""
    model = onnx.load(SAMPLES / "llama_tiny_legacy_op14.onnx")
    onnx.save(model, box.model / "llama.onnx", save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=256)
    assert len(list(box.model.iterdir())) > 5
    _outcome, problems = run_both(box, box.model / "llama.onnx", command, input_loads=True)
    assert not problems, f"{command}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------------------------------- gate-attack models

@pytest.mark.parametrize("attack", list(ATTACKS))
def test_gate_attack_models_other_commands(box: Sandbox, restore_cwd, attack: str):
    """The issue-19 attack models (tests/test_gate_attacks.py runs them through the issue's commands) through the
    remaining ones: explain --json, --external-data single --target onnx, decompose --no-verify."""
    builder, extra, valid = ATTACKS[attack]
    model = builder(box)
    problems = []
    for command in (c for c in COMMANDS if c not in GATE_COMMANDS):
        _outcome, found = run_both(box, model, command, input_loads=True if valid else None, extra=extra)
        problems += [f"{command}: {f}" for f in found]
    assert not problems, f"{attack}:\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------- real processes

@pytest.mark.parametrize("case, command", [("same_folder", "fuse"), ("missing", "fuse_no_verify"),
                                           ("subfolder", "explain_annotate")])
def test_through_a_process(box: Sandbox, case: str, command: str):
    """Real processes started in the seeded and in the empty directory: the same property."""
    path = _security_model(box, case)
    _outcome, problems = run_both(box, path, command, input_loads=None, subprocess_run=True)
    assert not problems, f"{case} / {command}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------------------------------- the fixture itself

def test_the_fixture_seeds_what_the_model_names(box: Sandbox, restore_cwd):
    """The seeded directory holds a canary for each data file, each common secret and each name; and a run that
    does read from it is caught (a ModelProto's external data is read from the working directory by design, see
    docs/security.md: the API on a proto is the one place where the cwd is the model folder)."""
    path = _security_model(box, "subfolder")
    written = seed_cwd(box.cwd, box.model, box.canaries)
    names = {str(p.relative_to(box.cwd)) for p in box.cwd.rglob("*") if p.is_file()}
    assert {"weights/w.data", ".env", ".ssh/id_rsa", ".aws/credentials", "id_rsa", "secret.bin"} <= names
    proto = onnx.load(path, load_external_data=False)
    assert {n.name for n in proto.graph.node} <= names and written == len(names)
    for f in box.cwd.rglob("*"):
        if f.is_file():
            assert f.read_bytes().startswith(b"LNCNRY")
    import lnfuse
    with working_directory(box.cwd):
        result = lnfuse.fuse(proto, verify=False)
        result.save(box.out / "o.onnx")
    found = leaks({"o.onnx": (box.out / "o.onnx").read_bytes(), "w.data": (box.out / "o.onnx.data").read_bytes()},
                  {}, box.canaries)
    assert found, "the detector sees the canary that the API read from the working directory"
