"""Docs that run: every shell and Python block of README.md and docs/*.md runs here, and every figure names the
command that measured it, with its date and machine (the conventions are in docs/development.md#docs-that-run).

Each page runs in a folder of its own, its blocks in order, as a reader pastes them: `sample_models/` is reachable
there (a link to the repository's), and `model.onnx`, the name the docs give "your model", is a copy of the shipped
BERT export. A block that cannot run here says why in a marker right above it: drift fails this test instead of
reaching a user.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
# What `model.onnx` in a runnable block stands for.
EXAMPLE_MODEL = REPO / "sample_models" / "bert_tiny_legacy_op14.onnx"
MARKER = re.compile(r"^<!--\s*([a-z ]+?)\s*:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")
# A duration is the one thing that changes between runs of the same versions: "0.91 s", "12 ms".
DURATION = re.compile(r"\b\d+(\.\d+)?\s?(s|ms)\b")
# <!-- figure: COMMAND (YYYY-MM-DD[ time][ at commit X], machine[, versions]) -->
FIGURE = re.compile(r"^(?P<command>\S.*?) \((?P<date>\d{4}-\d{2}-\d{2})[^,()]*, (?P<machine>[^()]+)\)$")
# A cell that starts with a number: "0.63 s", "**18 / 18**", "+0.26 s", "1,105".
NUMBER = re.compile(r"^\**[~<>≈+]?\s*-?\d[\d,.]*\b")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: list[str]
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str | None:
        """'python', 'shell' or None (text: a synopsis, a diagram, an output excerpt without its command)."""
        if self.lang == "python":
            return "python"
        if self.lang in SHELL_LANGS or (self.lang == "" and any(s.startswith("$ ") for s in self.body)):
            return "shell"
        return None


def markers_above(lines: list[str], index: int) -> dict[str, str]:
    """The `<!-- key: value -->` comments on the lines right above line `index` (stacked, no blank line between)."""
    found: dict[str, str] = {}
    i = index - 1
    while i >= 0 and (match := MARKER.match(lines[i].strip())):
        found[match.group(1)] = match.group(2)
        i -= 1
    return found


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent = i, len(match.group(1))
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = [s[indent:] for s in lines[start + 1 : i]]
        found.append(Block(page, start + 1, match.group(2), body, markers_above(lines, start)))
        i += 1
    return found


@dataclass
class Command:
    argv: list[str]
    line: str
    output: list[str] | None  # the lines shown after a `$ command`; None where the block shows none


def commands(block: Block) -> list[Command]:
    """Each command of a shell block, `&&` chains split, `\\` continuations joined, comments dropped. In a block
    with `$ ` prompts only prompted lines are commands, and the lines up to the next prompt are their output."""
    prompted = any(s.startswith("$ ") for s in block.body)
    found: list[Command] = []
    pending = ""
    for text in block.body:
        if prompted and not text.startswith("$ ") and not pending:
            if found:
                found[-1].output = (found[-1].output or []) + [text]
            continue
        text = text[2:] if prompted and text.startswith("$ ") else text
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        text, pending = pending + text, ""
        words = shlex.split(text, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(Command(words[:cut], text.strip(), [] if prompted else None))
            words = words[cut + 1 :]
    return found


def masked(lines: list[str]) -> list[str]:
    return [DURATION.sub("<duration>", s.rstrip()) for s in lines if s.strip()]


def program(argv: list[str], block: Block) -> list[str] | None:
    """The argv to run for a documented command, or None for an install step (this suite runs installed)."""
    head = argv[0]
    if head == "pip":
        return None
    if head == "lnfuse":
        script = Path(sys.executable).parent / "lnfuse"
        return [str(script), *argv[1:]] if script.exists() else [sys.executable, "-m", "lnfuse.cli", *argv[1:]]
    if head in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    pytest.fail(f"{block.where}: `{' '.join(argv)}` is not a command this test runs (lnfuse, python, pip): "
                "mark the block <!-- not run: why -->")


def folder_for(page: Path, tmp: Path) -> Path:
    here = tmp / page.stem
    here.mkdir()
    (here / "sample_models").symlink_to(REPO / "sample_models")
    shutil.copyfile(EXAMPLE_MODEL, here / "model.onnx")
    return here


def run_shell(block: Block, here: Path) -> None:
    for command in commands(block):
        argv = program(command.argv, block)
        if argv is None:
            continue
        done = subprocess.run(argv, cwd=here, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{block.where}: `{command.line}` exited {done.returncode}:\n{done.stderr}"
        if command.output is not None:
            assert masked(done.stdout.splitlines()) == masked(command.output), (
                f"{block.where}: `{command.line}` prints (durations masked):\n{done.stdout}")


def run_python(block: Block, previous: list[Block], here: Path) -> None:
    source = [*(s for b in previous for s in b.body), *block.body] if "continues" in block.markers else block.body
    script = here / f"block_{block.line}.py"
    script.write_text("\n".join(source) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, script.name], cwd=here, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{block.where}: the Python block raised:\n{done.stderr[-3000:]}"


def missing_modules(block: Block) -> list[str]:
    names = [n.strip() for n in block.markers.get("needs", "").split(",") if n.strip()]
    return [n for n in names if importlib.util.find_spec(n) is None]


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.kind and "not run" not in b.markers]


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_every_block_of_the_page_runs_as_pasted(page: Path, tmp_path: Path) -> None:
    here = folder_for(page, tmp_path)
    ran_python: list[Block] = []
    skipped = []
    for block in runnable(page):
        if missing := missing_modules(block):
            skipped.append(f"{block.where} needs {', '.join(missing)}")
            continue
        if block.kind == "shell":
            run_shell(block, here)
        else:
            run_python(block, ran_python, here)
            ran_python.append(block)
    if skipped and not ran_python and all(b.kind == "python" for b in runnable(page)):
        pytest.skip("; ".join(skipped))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_block_that_does_not_run_says_why(page: Path) -> None:
    for block in blocks(page):
        if "not run" in block.markers:
            assert block.kind, f"{block.where}: a `not run` marker on a block that is not code"
            reason = block.markers["not run"]
            assert len(reason.split()) >= 3, f"{block.where}: `not run` needs a reason a reader can act on"
        unknown = set(block.markers) - {"not run", "needs", "continues", "figure"}
        assert not unknown, f"{block.where}: unknown marker(s) {sorted(unknown)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_torch_is_installed_as_its_cpu_build(page: Path) -> None:
    """From PyPI, torch on Linux is the CUDA build (GBs of nvidia wheels); packages that require torch pull it the
    same way unless the CPU build is installed first. A venv with --system-site-packages made from inside a venv
    sees the base interpreter's packages, not the venv's."""
    pulls_torch = re.compile(r"\btorch\b|optimum|olive-ai|\[export\]|transformers")
    for block in blocks(page):
        if block.kind != "shell":
            continue
        cpu_torch_seen = False
        for command in commands(block):
            joined = " ".join(command.argv)
            assert "--system-site-packages" not in command.argv, f"{block.where}: `{joined}`"
            if "pip" not in Path(command.argv[0]).name or "install" not in command.argv:
                continue
            if "download.pytorch.org/whl/cpu" in joined:
                cpu_torch_seen = True
                continue
            assert not pulls_torch.search(joined) or cpu_torch_seen, (
                f"{block.where}: `{joined}` would install the CUDA torch: install "
                "torch from https://download.pytorch.org/whl/cpu first")


def tables(page: Path) -> list[tuple[int, list[list[str]], dict[str, str]]]:
    """(1-based line, rows, markers above) of each Markdown table outside fenced blocks."""
    lines = page.read_text(encoding="utf-8").split("\n")
    found, fenced, i = [], False, 0
    while i < len(lines):
        if FENCE.match(lines[i]) or lines[i].strip() == "```":
            fenced = not fenced
        if (not fenced and lines[i].startswith("|") and i + 1 < len(lines)
                and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip())):
            start, i = i, i + 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            found.append((start + 1, rows, markers_above(lines, start)))
            continue
        i += 1
    return found


def is_measurement(rows: list[list[str]]) -> bool:
    """A table of measured numbers: two or more columns whose cells mostly start with a number (one such column is
    a list of codes or limits)."""
    numeric = 0
    for column in range(max(len(r) for r in rows)):
        cells = [r[column] for r in rows if column < len(r) and r[column] not in ("", "-", "—")]
        numeric += bool(cells) and sum(bool(NUMBER.match(c)) for c in cells) * 2 >= len(cells)
    return numeric >= 2


def check_figure(where: str, marker: str | None) -> None:
    assert marker, (f"{where}: a figure without its source: put <!-- figure: python benchmarks/x.py ... "
                    "(YYYY-MM-DD, machine) --> right above it")
    match = FIGURE.match(marker)
    assert match, f"{where}: `figure: {marker}` is not `COMMAND (YYYY-MM-DD, machine)`"
    for script in (w for w in match.group("command").split() if w.endswith(".py") and "/" in w):
        assert (REPO / script).is_file(), f"{where}: {script} is not in the repository"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_names_its_command_date_and_machine(page: Path) -> None:
    for line, rows, markers in tables(page):
        if is_measurement(rows) or "figure" in markers:
            check_figure(f"{page.relative_to(REPO)}:{line}", markers.get("figure"))
    for block in blocks(page):
        shown = [c for c in commands(block) if c.output] if block.kind == "shell" else []
        if any(c.argv[:2] and c.argv[1].startswith("benchmarks/") for c in shown) or "figure" in block.markers:
            check_figure(block.where, block.markers.get("figure"))


def test_the_provenance_page_shows_what_lnfuse_writes(tmp_path: Path) -> None:
    """docs/provenance.md's model keys, from the command its table names, are what that command writes."""
    page = REPO / "docs" / "provenance.md"
    line, rows, _ = next(t for t in tables(page) if t[1][0][0] == "`lnfuse.version`")
    argv = program(["lnfuse", str(EXAMPLE_MODEL), "-o", str(tmp_path / "out.onnx")], Block(page, line, "", []))
    subprocess.run(argv, check=True, capture_output=True, cwd=tmp_path, timeout=120)
    written = {p.key: p.value for p in onnx.load(str(tmp_path / "out.onnx"), load_external_data=False).metadata_props}
    for key_cell, value_cell in rows:
        key, shown = key_cell.strip("`"), re.match(r"`([^`]*)`", value_cell).group(1)
        assert written.get(key) == shown, f"docs/provenance.md:{line}: {key} is {written.get(key)!r}, shown {shown!r}"
