"""No import circle anywhere in batchgen/ or kernels/ (installed as batchgen.kernels).

Each module's source is parsed with `ast` and every import statement in it counts: module level,
inside functions and under `if TYPE_CHECKING:` alike, since an import deferred into a function
still closes a circle (it only hides it until first use). `import batchgen.x` and `from batchgen.x
import y` lead to `batchgen.x.y` where that is a module, else to `batchgen.x` (y is a name in it);
relative imports are resolved against the importing module's package first. Importing a submodule
is not counted as importing its parent package's `__init__` (Python runs it first, but it does not
depend on it). The test fails naming every circle it finds, module by module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package name it installs as (pyproject.toml's package-dir).
SOURCES = {ROOT / "batchgen": "batchgen", ROOT / "kernels": "batchgen.kernels"}


def module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package `__init__`)."""
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join((package, *parts))] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool, modules: set[str]) -> set[str]:
    """The batchgen modules that module `name` (at `path`) imports, anywhere in its source."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    targets.add(f"{base}.{alias.name}")
                elif base in modules:
                    targets.add(base)
    targets.discard(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, pkg, set(files)) for name, (path, pkg) in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm), as the
    list of modules along it, the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

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
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to itself, inside the group."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def test_no_import_circle() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_the_walk_sees_relative_and_deferred_imports(tmp_path: Path) -> None:
    """The checker itself: a circle closed by a relative import inside a function is found."""
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from batchgen.x.a import f\n")
    (tmp_path / "__init__.py").write_text("")
    modules = {"batchgen.x", "batchgen.x.a", "batchgen.x.b"}
    graph = {
        "batchgen.x": imports_of("batchgen.x", tmp_path / "__init__.py", True, modules),
        "batchgen.x.a": imports_of("batchgen.x.a", tmp_path / "a.py", False, modules),
        "batchgen.x.b": imports_of("batchgen.x.b", tmp_path / "b.py", False, modules),
    }
    assert graph["batchgen.x.a"] == {"batchgen.x.b"} and graph["batchgen.x.b"] == {"batchgen.x.a"}
    assert circles(graph) == [["batchgen.x.a", "batchgen.x.b", "batchgen.x.a"]]
    assert "batchgen.model.attention.base" in import_graph()["batchgen.model.attention.torch_backend"]
