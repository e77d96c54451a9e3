"""The project's import graph has no cycles.

Nodes are the modules of the packages pyproject.toml ships (`[tool.setuptools.packages.find] include`).
An edge A -> B is any `import` or `from ... import` in A's source that names B or a module inside B,
wherever the statement sits: at module level, inside a function, or under `if TYPE_CHECKING:`. Imports
inside functions count because a deferred import is still a dependency; it only hides a cycle until
the function runs. `from pkg import name` counts as an edge to `pkg.name` when that is a module, else
to `pkg`. A package's `__init__` is a node of its own, and importing `pkg.mod` does not add an edge to
`pkg` (Python runs `pkg/__init__.py` first, but an `__init__` that imports nothing back cannot close a
cycle through it, and one that does shows up as its own edges).

Run as a script (`python -m tests.unit.test_import_graph`) it prints every cycle it finds.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def project_packages(root: Path = ROOT) -> list[str]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({p.rstrip("*").rstrip(".") for p in patterns if (root / p.rstrip("*").rstrip(".")).is_dir()})


def module_files(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package in project_packages(root):
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                if base is None:
                    continue
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                # The deepest project module the name falls in (`import a.b.c` of a function's module a.b).
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path start -> ... -> start inside one strongly connected component (breadth-first, so short)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {sorted(component)}")


def test_the_graph_covers_the_packages():
    graph = import_graph()
    assert {"engine", "worker", "schemas"} <= set(project_packages())
    assert "engine.engine_core" in graph and "engine.scheduler" in graph["engine.engine_core"]


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


if __name__ == "__main__":
    for cycle in find_cycles(import_graph()):
        print(" -> ".join(cycle))
