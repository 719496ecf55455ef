"""The layout's rules (docs/architecture.md), checked on the source: the product never imports the dev tooling or
Ray's private modules, the ``ingest`` subpackages import each other without cycles, ``ingest.sft`` is a leaf library,
and the code names no development machine's paths or issue numbers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVTOOLS = "tools"
# the one product file that names the dev tooling: ``python -m ingest bench`` hands over to it
ENTRY_POINT = ROOT / "ingest" / "__main__.py"


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _product_files() -> list[Path]:
    files = [*(ROOT / "ingest").rglob("*.py"), *(ROOT / "actors").rglob("*.py")]
    return [p for p in files if not _module(p).startswith(DEVTOOLS)]


def _imports(path: Path) -> list[str]:
    """Every module an import statement in ``path`` names (lazy imports inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _unit(module: str) -> str | None:
    """The part of the tree a module belongs to: ``actors``, an ``ingest`` subpackage, or a top-level module."""
    parts = module.split(".")
    if parts[0] == "actors":
        return "actors"
    if parts[0] != "ingest" or len(parts) == 1:
        return None  # the package root only re-exports
    return "ingest." + parts[1]


def test_the_product_never_imports_the_dev_tooling():
    offenders = {
        str(p.relative_to(ROOT)): [m for m in _imports(p) if m.startswith(DEVTOOLS)]
        for p in _product_files()
        if p != ENTRY_POINT
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_product_never_reaches_into_ray_private():
    offenders = [str(p.relative_to(ROOT)) for p in _product_files() if "ray._private" in p.read_text()]
    assert not offenders


def test_no_import_cycles_between_subpackages():
    edges: dict[str, set[str]] = {}
    for path in [*(ROOT / "ingest").rglob("*.py"), *(ROOT / "actors").rglob("*.py")]:
        source = _unit(_module(path))
        for target in filter(None, map(_unit, _imports(path))):
            if source and target != source and target in _units():
                edges.setdefault(source, set()).add(target)
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def _units() -> set[str]:
    units = {"actors"}
    for path in (ROOT / "ingest").iterdir():
        if path.suffix == ".py" and path.stem != "__init__":
            units.add(f"ingest.{path.stem}")
        elif (path / "__init__.py").is_file():
            units.add(f"ingest.{path.name}")
    return units


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_check_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_sft_is_a_leaf_library():
    """Importing every ``ingest.sft`` module loads no Ray, no pipeline stage, actor or dataset builder."""
    code = (
        "import sys, pkgutil, importlib, ingest.sft\n"
        "for m in pkgutil.iter_modules(ingest.sft.__path__): importlib.import_module('ingest.sft.' + m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'actors') or m.startswith(('ingest.stages',"
        " 'ingest.datasets', 'tools'))]\n"
        "print(bad)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout


def test_code_names_no_machine_paths_or_issue_numbers():
    pattern = re.compile(r"/work/|/home/\w+/|\bissues? #?\d+\b", re.IGNORECASE)
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in [*_product_files(), *(ROOT / "tools").rglob("*.py")]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders
