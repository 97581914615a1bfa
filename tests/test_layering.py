"""The package's layering, read from the source (issue 29: "a house without back doors").

lnfuse/ is grouped by stage: load -> index -> match -> verification -> save, with the engine, the API and the
commands above them. These tests read every module's imports with ``ast`` (nothing is imported or run) and hold
the layout to it:

1. no module uses another module's private (underscore) name: neither ``from x import _y``, nor ``x._y`` on a module
   it imported, nor a private module of another package (``rules/_common.py`` is the rules' own);
2. ``lnfuse/load`` imports nothing from ``lnfuse/save``;
3. the early stages do not import the later ones (load, index).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: where each package's sources live (``lnfuse.rules`` is the top-level ``rules/`` folder, see pyproject.toml)
SOURCES = {"lnfuse": ROOT / "lnfuse", "lnfuse.rules": ROOT / "rules"}

#: what the early stages must not import: a stage reads only what comes before it
FORBIDDEN = {
    "lnfuse.load": ("lnfuse.match", "lnfuse.verification", "lnfuse.save", "lnfuse.commands", "lnfuse.zoo",
                    "lnfuse.engine", "lnfuse.api", "lnfuse.rewrite", "lnfuse.rules", "lnfuse.integrations",
                    "lnfuse.report", "lnfuse.cli"),
    "lnfuse.index": ("lnfuse.match", "lnfuse.verification", "lnfuse.save", "lnfuse.commands", "lnfuse.zoo",
                     "lnfuse.engine", "lnfuse.api", "lnfuse.rewrite", "lnfuse.rules", "lnfuse.integrations",
                     "lnfuse.report", "lnfuse.cli", "lnfuse.load"),
}


@dataclass(frozen=True)
class Import:
    """One name a module takes from another: ``name`` None for a whole module."""

    where: str  # file:line, for the failure message
    importer: str  # the importing module
    module: str  # the module imported, or the one the name is taken from
    name: str | None = None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of lnfuse: its name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = _package(importer, is_package).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, importer: str, is_package: bool, known: set[str], where: str = "<source>"
               ) -> tuple[list[Import], list[Import]]:
    """What ``source`` (the module ``importer``) imports, and which private attributes it reads of the modules it
    imported (as ``Import``s of that name): at any depth, imports inside functions included. ``known``: the names
    of lnfuse's modules (``from package import module`` imports a module, not a name)."""
    tree = ast.parse(source)
    found, bound = [], {}
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(at, importer, alias.name))
                # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``
                bound[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                    alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, importer, is_package)
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    found.append(Import(at, importer, f"{module}.{alias.name}"))
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
                else:
                    found.append(Import(at, importer, module, alias.name))
    attributes = [Import(f"{where}:{node.lineno}", importer, bound[node.value.id], node.attr)
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in bound and _private(node.attr)]
    return found, attributes


def _all_imports() -> tuple[list[Import], list[Import]]:
    modules = _modules()
    imports, attributes = [], []
    for module, (path, is_package) in modules.items():
        found, read = imports_of(path.read_text(), module, is_package, set(modules), str(path.relative_to(ROOT)))
        imports += found
        attributes += read
    return imports, attributes


def back_doors(imports: list[Import], attributes: list[Import]) -> list[str]:
    """Every use of a private name across modules, as ``file:line: what``."""
    found = []
    for imp in imports:
        if imp.name is not None and _private(imp.name) and imp.module != imp.importer and imp.module != "__future__":
            found.append(f"{imp.where}: from {imp.module} import {imp.name}")
        parts = imp.module.split(".")
        for depth, part in enumerate(parts):
            # a private module belongs to its package: the package's own modules may import it, no other
            owner = ".".join(parts[:depth])
            if _private(part) and not (imp.importer == owner or imp.importer.startswith(owner + ".")):
                found.append(f"{imp.where}: imports the private module {'.'.join(parts[:depth + 1])}")
                break
    for read in attributes:
        if read.module.startswith("lnfuse") and read.module != read.importer:
            found.append(f"{read.where}: reads {read.module}.{read.name}")
    return found


def arrows(imports: list[Import], stage: str, forbidden: tuple[str, ...]) -> list[str]:
    """The imports by the modules of ``stage`` of a module in (or a name from) the ``forbidden`` ones."""
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return [f"{imp.where}: {imp.importer} imports {imp.module}" + (f".{imp.name}" if imp.name else "")
            for imp in imports if inside(imp.importer, stage)
            and any(inside(imp.module, f) or (imp.name and inside(f"{imp.module}.{imp.name}", f))
                    for f in forbidden)]


@pytest.fixture(scope="module")
def scanned() -> tuple[list[Import], list[Import]]:
    return _all_imports()  # once for the module: parsing every file takes seconds


def test_no_module_uses_another_modules_private_names(scanned):
    imports, attributes = scanned
    found = back_doors(imports, attributes)
    assert not found, "private names used across modules (make the name public, or move what is shared to a " \
                      "module below both):\n" + "\n".join(found)


def test_load_imports_nothing_from_save(scanned):
    imports, _ = scanned
    found = arrows(imports, "lnfuse.load", ("lnfuse.save",))
    assert not found, "reading (lnfuse/load) must not depend on writing (lnfuse/save):\n" + "\n".join(found)


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_an_early_stage_imports_no_later_one(stage, scanned):
    imports, _ = scanned
    found = arrows(imports, stage, FORBIDDEN[stage])
    assert not found, f"{stage} imports a later stage:\n" + "\n".join(found)


def test_the_scan_sees_every_module_and_the_imports_that_matter(scanned):
    # the tests above pass vacuously if the scan finds nothing: it must see the package and its known imports
    modules = _modules()
    assert {"lnfuse.engine", "lnfuse.load.io", "lnfuse.index.scopes", "lnfuse.rules._common",
            "lnfuse.rules.layer_norm", "lnfuse.save.write"} <= set(modules)
    imports, _ = scanned
    pairs = {(imp.importer, imp.module) for imp in imports}
    assert ("lnfuse.engine", "lnfuse.index.scopes") in pairs
    assert ("lnfuse.rules.layer_norm", "lnfuse.rules._common") in pairs  # a relative import, resolved
    assert ("lnfuse.save.write", "lnfuse.load.io") in pairs  # ``from lnfuse.load import io``: a module


@pytest.mark.parametrize("source, importer, expected", [
    ("from lnfuse.engine import _all_names", "lnfuse.commands.decompose",
     "from lnfuse.engine import _all_names"),
    ("def f():\n    from lnfuse.api import FuseResult, _op_counts", "lnfuse.commands.decompose",
     "from lnfuse.api import _op_counts"),
    ("from .shapes import _Claims", "lnfuse.index.demand", "from lnfuse.index.shapes import _Claims"),
    ("from lnfuse.index import shapes\nshapes._take_claims(g)", "lnfuse.index.demand",
     "reads lnfuse.index.shapes._take_claims"),
    ("import lnfuse.engine as e\ne._all_names(m)", "lnfuse.api", "reads lnfuse.engine._all_names"),
    ("from lnfuse.rules._norm import new_nodes", "lnfuse.commands.decompose",
     "imports the private module lnfuse.rules._norm"),
    ("from onnx_ir import _core", "lnfuse.load.weights", "from onnx_ir import _core"),
])
def test_the_scan_finds_each_kind_of_back_door(source, importer, expected):
    known = set(_modules())
    imports, attributes = imports_of(source, importer, False, known)
    assert any(expected in line for line in back_doors(imports, attributes)), back_doors(imports, attributes)


@pytest.mark.parametrize("source, importer", [
    ("from ._common import node_name", "lnfuse.rules.layer_norm"),  # a package's private module, its own
    ("from lnfuse.index.scopes import scopes", "lnfuse.save.annotate"),
    ("from __future__ import annotations", "lnfuse.api"),
    ("import os\nos._exit(0)", "lnfuse.cli"),  # public in the standard library, whatever its spelling
])
def test_the_scan_lets_public_and_own_names_pass(source, importer):
    imports, attributes = imports_of(source, importer, False, set(_modules()))
    assert back_doors(imports, attributes) == []


def test_the_scan_finds_an_arrow_back_up():
    known = set(_modules())
    imports, _ = imports_of("from lnfuse.save import staging", "lnfuse.load.io", False, known)
    assert arrows(imports, "lnfuse.load", ("lnfuse.save",))
    imports, _ = imports_of("from lnfuse import engine", "lnfuse.index.shapes", False, known)
    assert arrows(imports, "lnfuse.index", FORBIDDEN["lnfuse.index"])
