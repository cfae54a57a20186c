"""The package's import graph, read from the source with ``ast`` (nothing is imported).

Shared by ``test_architecture.py`` (no cycle among the imports that run) and
``test_layering.py`` (layers; no cycle even through type-only imports).

An edge is the module an import statement names: ``from .a import b`` points
at ``a.b`` when that is a module, else at ``a`` (a package's ``__init__``).
The parent packages Python runs on the way are not edges, or every module would
sit in a cycle with any package ``__init__`` that imports its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Iterable, Iterator

PACKAGE = "slurm_resilience"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module in the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from runtime_nodes(other)
        else:
            yield from runtime_nodes(child)


def targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    else:
        return []
    out = []
    for name in names:
        # ``import a.b.c`` of a non-module attribute path: the longest known prefix
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE) and name not in out:
            out.append(name)
    return out


def import_graph(nodes: Callable[[ast.AST], Iterable[ast.AST]]) -> dict[str, dict[str, int]]:
    """module → {imported module: line of its first import}, over the statements
    ``nodes(tree)`` yields: :func:`runtime_nodes` leaves ``if TYPE_CHECKING:`` imports
    out, ``ast.walk`` counts every import."""
    mods = modules()
    known = set(mods)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, int] = {}
        for node in nodes(tree):
            for target in targets(node, name, path.name == "__init__.py", known):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component (Tarjan), as module lists
    whose first element is repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def connect(v: str) -> None:  # recursion depth is bounded by the package's size
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_shortest_cycle(graph, comp) for comp in sorted(sccs)]


def _shortest_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    members = set(comp)
    start = comp[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [cycle[-1]])
