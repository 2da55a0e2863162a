"""engine/ has no import cycle: the module graph built from every ``import`` statement of
engine/**/*.py (at module level, inside functions, or under ``TYPE_CHECKING``) is acyclic.

``from package import name`` depends on ``package.name`` when that is a module of the package,
else on ``package`` itself; a module's own package is initialised before it in any case, so that
edge is not counted.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_names(root: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (under ``root``) and the modules of the package it imports."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_engine_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, "engine")
    assert len(graph) > 20 and "engine.scheduler" in graph
    assert "engine.kv_cache_manager" in graph["engine.scheduler"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files",
    [
        {"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"},
        # Inside a function and under TYPE_CHECKING count too.
        {
            "a.py": "def f():\n    from pkg.b import g\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        },
        {"sub/__init__.py": "from .x import y\n", "sub/x.py": "from pkg.sub import z\n"},
    ],
    ids=["module-level", "deferred", "package-init"],
)
def test_a_cycle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", **{f"pkg/{k}": v for k, v in files.items()}})
    assert find_cycle(import_graph(tmp_path, "pkg")) is not None


def test_a_child_importing_its_package_is_no_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "x = 1\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycle(graph) is None
