"""Nothing a model or its folder names reaches the terminal raw (issue 27, "one printer"): node, value and graph
names, op types, doc strings, metadata, file and folder names holding escape sequences (window title, OSC 52
clipboard, clear screen), C1 controls, bidi overrides, carriage returns, backspaces and newlines followed by a forged
verdict, through every command's text output, errors, and the many-model run's progress and table. Real models
built with onnx.helper, the real command in a subprocess (on pipes, and on a terminal)."""

from __future__ import annotations

import ast
import json
import os
import re
import select
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest
from normgraphs import Spec, build
from onnx import TensorProto

from lnfuse.terminal import escape

ROOT = Path(__file__).resolve().parent.parent
FORGED = "lnfuse check: 0 candidate(s) left unfused, 9 fusable"
#: what a hostile model puts in every string it holds: window title, clipboard, clear screen, a C1 CSI, bidi
#: override and isolate, NEL, line separator, CR, backspace, vertical tab, form feed, and a forged verdict line
EVIL = ("\x1b]0;title\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m\u202e\u2066\u200f\u061c\x85\u2028\r\b\v\f\n"
        + FORGED + "\n")
#: what may not appear raw in anything lnfuse prints (a newline only between lnfuse's own lines)
HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs", "Cn"}


# -- models ------------------------------------------------------------------------------------------------------

def _hostile(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every name, doc string and metadata entry of ``model`` made to carry EVIL."""
    graph, names = model.graph, {}

    def name(old: str) -> str:
        return names.setdefault(old, old + EVIL) if old else old

    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = name(value.name)
    for tensor in graph.initializer:
        tensor.name = name(tensor.name)
    for node in graph.node:
        node.name, node.doc_string = "n" + EVIL + node.name, EVIL
        node.input[:] = [name(i) for i in node.input]
        node.output[:] = [name(o) for o in node.output]
    graph.name, graph.doc_string, model.doc_string, model.producer_name = "g" + EVIL, EVIL, EVIL, EVIL
    oh.set_model_props(model, {"key" + EVIL: EVIL})
    return model


def _fusable(path: Path) -> Path:
    onnx.save(_hostile(build(Spec())), path)
    return path


def _left(path: Path) -> Path:
    """A LayerNorm left unfused: its epsilon is a graph input (named with EVIL), the refusal quotes the names."""
    onnx.save(_hostile(build(Spec(mutation="eps_runtime"))), path)
    return path


def _left_by_custom_op(path: Path) -> Path:
    """A LayerNorm left unfused because its epsilon comes from an op whose type and domain hold EVIL: the refusal
    names the op type."""
    model = build(Spec(mutation="eps_runtime"))
    graph = model.graph
    graph.input.remove(next(i for i in graph.input if i.name == "EPS"))
    graph.input.append(oh.make_tensor_value_info("E0", TensorProto.FLOAT, []))
    graph.node.insert(0, oh.make_node("Op" + EVIL, ["E0"], ["EPS"], name="custom" + EVIL, domain="dom" + EVIL))
    model.opset_import.append(oh.make_opsetid("dom" + EVIL, 1))
    onnx.save(model, path)
    return path


def _missing_data(path: Path) -> Path:
    """A model whose external data location holds EVIL (and names no file): refused, exit 2, naming it."""
    model = build(Spec())
    tensor = model.graph.initializer[0]
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "w" + EVIL + ".data"
    onnx.save(model, path)
    return path


# -- running the command -------------------------------------------------------------------------------------------

def _lnfuse(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnfuse.cli", *map(os.fsdecode, args)], capture_output=True,
                          timeout=300, cwd=cwd)


def _shown(raw: bytes) -> str:
    """What lnfuse printed: valid UTF-8 (a name that is not UTF-8 is escaped, not passed on), and no character a
    terminal acts on or a reader cannot see but the line breaks between lnfuse's own lines."""
    text = raw.decode("utf-8")
    for line in text.split("\n"):
        hidden = [c for c in line if unicodedata.category(c) in HIDDEN]
        assert not hidden, f"raw {hidden!r} in {line!r}"
    return text


def _verdicts(text: str) -> list[str]:
    """The lines that start like check's verdict, whatever a viewer takes for a line break."""
    return [line for line in text.splitlines() if line.startswith("lnfuse check:")]


def _received(*args: object, cwd: Path, env: dict | None = None) -> tuple[int, str]:
    """The command with stdout and stderr on a pseudo-terminal (``TERM=xterm``, no ``NO_COLOR``, unless ``env``
    says otherwise): its exit code and everything the terminal received."""
    master, slave = os.openpty()
    environment = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | {"TERM": "xterm"} | (env or {})
    proc = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", *map(os.fsdecode, args)], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, cwd=cwd, env=environment)
    os.close(slave)
    received, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1)[0]:
            if proc.poll() is not None and not select.select([master], [], [], 0.5)[0]:
                break
            continue
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    code = proc.wait(timeout=60)
    return code, received.decode("utf-8").replace("\r\n", "\n")  # the terminal's own line discipline


def _on_a_terminal(*args: object, cwd: Path) -> tuple[int, str]:
    """The command on a pseudo-terminal: colours and progress bars on. Returns the exit code and what the terminal
    received, lnfuse's own codes (its colours, the bar's return-and-clear) taken out."""
    code, text = _received(*args, cwd=cwd)
    assert "\x1b[K" in text or "\x1b[" in text, "the run drew no bar or colour: nothing was tested"
    return code, re.sub(r"\r\x1b\[K|\x1b\[(?:0|1|32|33)m", "", text)


def test_no_color_and_a_dumb_terminal_are_heeded(tmp_path: Path):
    """``NO_COLOR``: no colour, the bar still drawn; ``TERM=dumb``: no code at all (it shows them as text)."""
    model = _fusable(tmp_path / "m.onnx")
    code, text = _received(model, "-o", tmp_path / "a.onnx", cwd=tmp_path, env={"NO_COLOR": "1"})
    assert code == 0 and not re.search(r"\x1b\[(?:1|32|33)m", text), text
    code, text = _received(model, "-o", tmp_path / "b.onnx", cwd=tmp_path, env={"TERM": "dumb"})
    assert code == 0 and "\x1b" not in text and "\r" not in text.replace("\r\n", ""), text


# -- the escape itself and who may print ---------------------------------------------------------------------------

def test_every_hidden_character_is_escaped_and_nothing_else():
    """All of Unicode at once: what the escape leaves is visible, and a visible character is left as it is."""
    everything = "".join(map(chr, range(0x110000)))
    shown = escape(everything)
    assert not [c for c in shown if unicodedata.category(c) in HIDDEN]
    assert escape(shown) == shown, "escaping twice changes nothing"
    named = ("\x1b\x9b\x85\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u2028\u2029"
             "\n\r\v\f\b\x7f")
    assert escape(named) == named.encode("unicode_escape").decode("ascii")
    assert escape("é 中 ✓ \\n") == "é 中 ✓ \\n"


#: writes to the terminal, found by the syntax tree: only lnfuse/terminal.py may make them
_EMITTERS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}


def _terminal_writes(tree: ast.AST) -> list[str]:
    loggers = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
               and node.value.func.attr == "getLogger" for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("print", "breakpoint"):
            found.append(f"{node.func.id}() at line {node.lineno}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            if owner == "sys" and attr in ("stdout", "stderr", "__stdout__", "__stderr__", "displayhook"):
                found.append(f"sys.{attr} at line {node.lineno}")
            elif owner == "warnings" and attr in ("warn", "warn_explicit", "showwarning"):
                found.append(f"warnings.{attr} at line {node.lineno}")
            elif owner == "traceback" and attr.startswith("print"):
                found.append(f"traceback.{attr} at line {node.lineno}")
            elif (owner == "logging" and attr in _EMITTERS | {"basicConfig", "StreamHandler"}) or \
                    (owner in loggers and attr in _EMITTERS):
                found.append(f"{owner}.{attr} at line {node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "os" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in (1, 2):
            found.append(f"os.write({node.args[0].value}, ...) at line {node.lineno}")
    return found


def test_only_the_printer_writes_to_the_terminal():
    """Every line lnfuse shows goes through lnfuse.terminal: no print(), no sys.stdout/stderr, no warnings.warn, no
    logging call, no os.write to fd 1 or 2 anywhere else in lnfuse/ or rules/."""
    sources = sorted((ROOT / "lnfuse").rglob("*.py")) + sorted((ROOT / "rules").rglob("*.py"))
    assert len(sources) > 20
    found = {str(path.relative_to(ROOT)): writes for path in sources if path != ROOT / "lnfuse" / "terminal.py"
             if (writes := _terminal_writes(ast.parse(path.read_text(), str(path))))}
    assert not found, found
    assert _terminal_writes(ast.parse("import sys, logging\nlog = logging.getLogger(__name__)\nprint(1)\n"
                                      "sys.stderr.write('x')\nlog.warning('x')\n")) != [], "the check finds them"


# -- the commands on hostile models --------------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A model folder whose own name holds EVIL (a folder name from a download)."""
    path = tmp_path / ("models" + EVIL)
    path.mkdir()
    return path


def test_fuse_summary_and_verbose_list(folder: Path, tmp_path: Path):
    model = _fusable(folder / ("m" + EVIL + ".onnx"))
    proc = _lnfuse(model, "-o", tmp_path / "out.onnx", "-v")
    assert proc.returncode == 0, proc.stderr
    out = _shown(proc.stdout) + _shown(proc.stderr)
    assert "fused LayerNormalization in main from 9 nodes (n\\x1b]0;title\\x07" in out, out
    assert "\\u202e\\u2066\\u200f\\u061c\\x85\\u2028\\r\\x08\\x0b\\x0c\\n" + FORGED in out
    assert _verdicts(out) == [] and out.count("\nwrote ") == 1


@pytest.mark.parametrize("make", [_left, _left_by_custom_op])
def test_check_and_explain_show_one_real_verdict(folder: Path, make):
    model = make(folder / ("m" + EVIL + ".onnx"))
    proc = _lnfuse("check", model, "-v")
    assert proc.returncode == 1, proc.stderr
    out = _shown(proc.stdout) + _shown(proc.stderr)
    assert _verdicts(out) == ["lnfuse check: 1 candidate(s) left unfused, 0 fusable"], out
    assert "[layer_norm/epsilon]" in out and ("Op\\x1b]0;title" in out) == (make is _left_by_custom_op), out
    proc = _lnfuse("explain", model, "-v")
    assert proc.returncode == 0, proc.stderr
    out = _shown(proc.stdout) + _shown(proc.stderr)
    assert _verdicts(out) == [] and len([l for l in out.splitlines() if l.startswith("LEFT ")]) == 1, out


def test_json_keeps_the_exact_strings_in_ascii(folder: Path):
    """--json (and report files) keep every string exactly; ensure_ascii writes them as JSON escapes, so no raw
    control or bidi character reaches the terminal there either."""
    model = _left(folder / "m.onnx")
    for command in (("check", model, "--json"), ("explain", model, "--json")):
        proc = _lnfuse(*command)
        assert proc.returncode == (1 if command[0] == "check" else 0), proc.stderr
        assert proc.stdout.isascii() and proc.stderr == b""
        [left] = json.loads(proc.stdout)["unfused"]
        assert ("n" + EVIL + "ReduceMean_2") in left["anchor"] and ("EPS" + EVIL) in left["reason"], left


def test_errors_are_one_escaped_line(folder: Path, tmp_path: Path):
    for args in ((_missing_data(folder / "bad.onnx"), "-o", tmp_path / "o.onnx"),  # a location the model names
                 (folder / ("missing" + EVIL + ".onnx"), "-o", tmp_path / "o.onnx"),  # a path that is not there
                 ("--target", "ort" + EVIL, folder / "m.onnx", "-o", tmp_path / "o.onnx"),  # argparse's errors
                 (folder / "m.onnx", "-o", tmp_path / "o.onnx", "extra" + EVIL)):  # a shell glob's odd file name
        proc = _lnfuse(*args)
        assert proc.returncode == 2 and proc.stdout == b"", proc.stderr
        err = _shown(proc.stderr)
        [error] = [line for line in err.splitlines() if "error:" in line]
        assert err.endswith(error + "\n") and "\\x1b]0;title\\x07" in error and "Traceback" not in err, err
        assert _verdicts(err) == []


def _zoo(tmp_path: Path) -> Path:
    """A downloaded tree: a folder and a file named with EVIL, a model left unfused, one refused with EVIL in its
    reason, one whose file name is not UTF-8."""
    zoo = tmp_path / "zoo"
    sub = zoo / ("dir" + EVIL)
    sub.mkdir(parents=True)
    _fusable(sub / ("m" + EVIL + ".onnx"))
    _left(zoo / ("left" + EVIL + ".onnx"))
    _missing_data(zoo / "bad.onnx")
    _left_by_custom_op(zoo / "x.onnx")
    os.rename(zoo / "x.onnx", os.fsencode(zoo) + b"/x\xff.onnx")
    return zoo


def test_many_models_progress_and_table(tmp_path: Path):
    zoo = _zoo(tmp_path)
    proc = _lnfuse(zoo, "-o", tmp_path / "out", "--jobs", "1", "-v")
    assert proc.returncode == 2, proc.stderr
    err, out = _shown(proc.stderr), _shown(proc.stdout)
    progress = err.splitlines()
    assert len(progress) == 4 and all(re.match(r"\[\d/4\] ", line) for line in progress), err
    assert "dir\\x1b]0;title" in err and "x\\udcff.onnx" in err and "\\x9b31m\\u202e" in err, err
    rows = [line for line in out.splitlines() if re.match(r"[0-3] +(fused|candidates left|bad input) ", line)]
    assert len(rows) == 4, out
    assert _verdicts(err + out) == []


def test_on_a_terminal_only_lnfuses_own_codes_arrive(folder: Path, tmp_path: Path):
    """On a terminal lnfuse draws colours and progress bars with its own codes; every name is still escaped."""
    model = _fusable(folder / ("m" + EVIL + ".onnx"))
    code, shown = _on_a_terminal(model, "-o", tmp_path / "out.onnx", "-v", cwd=tmp_path)
    assert code == 0, shown
    assert "lnfuse: " in _shown(shown.encode()) and _verdicts(shown) == []
    code, shown = _on_a_terminal(_zoo(tmp_path), "-o", tmp_path / "many", "--jobs", "1", cwd=tmp_path)
    assert code == 2, shown
    assert "this run:" in _shown(shown.encode()) and _verdicts(shown) == []


def test_the_progress_line_keeps_a_long_names_start_and_end(tmp_path: Path):
    """A model deep in a tree: the bar shows its first folder and its file name, the middle left out."""
    deep = tmp_path / "zoo" / "organisation" / ("a-very-long-family-name-" * 3) / "variant"
    deep.mkdir(parents=True)
    _fusable(deep / "model_quantized.onnx")
    _fusable(tmp_path / "zoo" / "other.onnx")
    code, text = _received(tmp_path / "zoo", "-o", tmp_path / "out", "--jobs", "1", cwd=tmp_path)
    assert code == 0, text
    assert "organisation/…" in text and "model_quantized.onnx" in text, text


def test_no_eta_from_the_first_models_alone(tmp_path: Path):
    """The first models carry the workers' start-up: the bar says no ETA until three have finished (or all)."""
    (tmp_path / "zoo").mkdir()
    for name in ("a", "b"):
        _fusable(tmp_path / "zoo" / f"{name}.onnx")
    code, text = _received(tmp_path / "zoo", "-o", tmp_path / "out", "--jobs", "1", cwd=tmp_path)
    assert code == 0, text
    after_one = [part for part in text.split("\r") if "1/2 done" in part]
    assert after_one and all("ETA --:--" in part for part in after_one), after_one
