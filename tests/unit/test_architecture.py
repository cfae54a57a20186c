"""Architecture checks on the package's source: no import cycle, no module over
400 lines, no mixin. They read the files with ``ast`` and import nothing.

Which imports count for cycles: every import that can run — module level and
inside functions alike — but not those under ``if TYPE_CHECKING:`` (never run;
annotations only). A function-level import does not break a cycle, it only
hides it from the interpreter: the two modules still need each other and
neither can be read, tested or moved alone. Deferred imports stay welcome for
what they are for, keeping torch or matplotlib off light paths (the CLI,
``slurm_resilience.__getattr__``): those point down the layers and close no cycle.

An edge is the module an import statement names: ``from .a import b`` points
at ``a.b`` when that is a module, else at ``a`` (a package's ``__init__``).
The parent packages Python runs on the way are not edges, or every module would
sit in a cycle with any package ``__init__`` that imports its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = "slurm_resilience"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every module in the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
        else:
            yield from _runtime_nodes(child)


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> list[str]:
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


def import_graph() -> dict[str, dict[str, int]]:
    """module → {imported module: line of its first import}, TYPE_CHECKING imports left out."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, int] = {}
        for node in _runtime_nodes(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
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


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [cycle[-1]])


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (TYPE_CHECKING imports aside):\n  " + "\n  ".join(
        _describe(graph, c) for c in cycles)


def test_no_module_over_400_lines():
    long_ = {name: n for name, path in _modules().items()
             if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long_, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long_.items(), key=lambda kv: -kv[1]))


def test_no_mixin():
    """A mixin's methods use attributes that another class sets: neither reads alone."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            doc = ast.get_docstring(node) or ""
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            if (node.name.endswith("Mixin") or "mixin" in doc.lower()
                    or any(b.endswith("Mixin") for b in bases)):
                found.append(f"{name}.{node.name} (line {node.lineno})")
    assert not found, "mixin classes: " + ", ".join(found)


# The checker itself, on made-up graphs.

def test_find_cycles_names_each_cycle_once():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "x": {"y": 5}, "y": {"x": 6}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert _describe(graph, ["x", "y", "x"]) == "x (line 5) -> y (line 6) -> x"


def test_find_cycles_accepts_a_dag():
    assert find_cycles({"a": {"b": 1, "c": 1}, "b": {"c": 2}, "c": {}}) == []


def test_targets_resolve_relative_and_absolute_imports():
    known = {"slurm_resilience", "slurm_resilience.config", "slurm_resilience.supervisor",
             "slurm_resilience.supervisor.executors.loop", "slurm_resilience.supervisor.observe.detect"}
    mod = "slurm_resilience.supervisor.executors.loop"

    def targets(src: str, module: str = mod, is_package: bool = False) -> list[str]:
        return _targets(ast.parse(src).body[0], module, is_package, known)

    assert targets("from ...config import load_config") == ["slurm_resilience.config"]
    assert targets("from ..observe import detect") == ["slurm_resilience.supervisor.observe.detect"]
    assert targets("from ..observe.detect import Fault") == ["slurm_resilience.supervisor.observe.detect"]
    assert targets("from .observe import detect", "slurm_resilience.supervisor", True) == [
        "slurm_resilience.supervisor.observe.detect"]
    assert targets("import slurm_resilience.config as c") == ["slurm_resilience.config"]
    assert targets("from slurm_resilience import nothing_here") == ["slurm_resilience"]
    assert targets("import torch") == []


def test_type_checking_imports_do_not_count_function_imports_do():
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
           "def f():\n    import c\nclass K:\n    import d\ntry:\n    import e\nexcept ImportError:\n    import g\n"
           "if typing.TYPE_CHECKING:\n    import h\n")
    names = [a.name for n in _runtime_nodes(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["b", "c", "d", "e", "g"]
