"""No import cycle among the modules of `python/waltz`.

Every import counts, wherever it sits: at the top, inside a function (which only hides a cycle
until the function runs) and under `if TYPE_CHECKING:` (a cycle of types is still two modules
that cannot be read, or split, one without the other). The implicit import of a parent package
(`import waltz.a.b` runs `waltz/a/__init__.py`) is not an edge: a package's `__init__` that
re-exports its modules would otherwise close a cycle with each of them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest


def _package_root() -> pathlib.Path:
    for parent in pathlib.Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").exists():
            return parent / "python" / "waltz"
    raise AssertionError("no pyproject.toml above this test")


def _module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (anywhere in its file)."""
    files = _module_names(root)
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module `pkg.mod`; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            # Names outside the tree (the standard library, `waltz._native`, an extension) are no edge.
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_waltz_has_no_import_cycle() -> None:
    graph = import_graph(_package_root())
    assert "waltz.client.aio" in graph, "the walk found none of the package's modules"
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "a_imports",
    [
        "from pkg.b import f\n",
        "def later():\n    from pkg.b import f\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import f\n",
        "from .b import f\n",
        "from pkg import b\n",
        "import pkg.b.inner\n",
    ],
)
def test_the_walk_sees_every_kind_of_import(tmp_path: pathlib.Path, a_imports: str) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": a_imports,
            "pkg/b/__init__.py": "from pkg.a import g\n",
            "pkg/b/inner.py": "from pkg.a import g\n",
        },
    )
    assert cycles(import_graph(root)) != []


def test_a_package_reexporting_its_modules_is_no_cycle(tmp_path: pathlib.Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\nfrom pkg.b import g\n",
            "pkg/a.py": "def f(): ...\n",
            "pkg/b.py": "from pkg.a import f\ndef g(): ...\n",
        },
    )
    assert import_graph(root)["pkg"] == {"pkg.a", "pkg.b"}
    assert cycles(import_graph(root)) == []
