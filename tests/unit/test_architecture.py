"""Architecture checks on the package's source: no import cycle, no module over
400 lines, no mixin. They read the files with ``ast`` and import nothing.

Which imports count for cycles: every import that can run — module level and
inside functions alike — but not those under ``if TYPE_CHECKING:`` (never run;
annotations only). A function-level import does not break a cycle, it only
hides it from the interpreter: the two modules still need each other and
neither can be read, tested or moved alone. Deferred imports stay welcome for
what they are for, keeping torch or matplotlib off light paths (the CLI,
``slurm_resilience.__getattr__``): those point down the layers and close no cycle.

What an edge is, and the graph itself: ``importgraph.py`` (shared with
``test_layering.py``).
"""

from __future__ import annotations

import ast

from importgraph import describe, find_cycles, import_graph, modules, runtime_nodes, targets

MAX_LINES = 400


def test_no_import_cycle():
    graph = import_graph(runtime_nodes)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (TYPE_CHECKING imports aside):\n  " + "\n  ".join(
        describe(graph, c) for c in cycles)


def test_no_module_over_400_lines():
    long_ = {name: n for name, path in modules().items()
             if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long_, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long_.items(), key=lambda kv: -kv[1]))


def test_no_mixin():
    """A mixin's methods use attributes that another class sets: neither reads alone."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            doc = ast.get_docstring(node) or ""
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            if (node.name.endswith("Mixin") or "mixin" in doc.lower()
                    or any(b.endswith("Mixin") for b in bases)):
                found.append(f"{name}.{node.name} (line {node.lineno})")
    assert not found, "mixin classes: " + ", ".join(found)


def _defined(tree: ast.Module) -> set[str]:
    """Names bound anywhere in a module (defs, classes, assignments, imports): a generous test."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_name_in_all_exists():
    """``__all__`` lists only names the module defines or imports, or, for a package whose
    ``__getattr__`` loads names lazily, names its table holds as strings."""
    missing = []
    for name, path in modules().items():
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
        listed = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                       and any(getattr(t, "id", None) == "__all__" for t in node.targets)), None)
        if not isinstance(listed, (ast.List, ast.Tuple)):
            continue
        own = {id(e) for e in listed.elts}
        held = _defined(tree) | {c.value for c in ast.walk(tree) if isinstance(c, ast.Constant)
                                 and isinstance(c.value, str) and id(c) not in own}
        missing += [f"{name}.{e.value}" for e in listed.elts if isinstance(e, ast.Constant) and e.value not in held]
    assert not missing, "in __all__ but not defined: " + ", ".join(missing)


# The checker itself, on made-up graphs.

def test_find_cycles_names_each_cycle_once():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "x": {"y": 5}, "y": {"x": 6}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert describe(graph, ["x", "y", "x"]) == "x (line 5) -> y (line 6) -> x"


def test_find_cycles_accepts_a_dag():
    assert find_cycles({"a": {"b": 1, "c": 1}, "b": {"c": 2}, "c": {}}) == []


def test_targets_resolve_relative_and_absolute_imports():
    known = {"slurm_resilience", "slurm_resilience.config", "slurm_resilience.supervisor",
             "slurm_resilience.supervisor.executors.loop", "slurm_resilience.supervisor.observe.detect"}
    mod = "slurm_resilience.supervisor.executors.loop"

    def named(src: str, module: str = mod, is_package: bool = False) -> list[str]:
        return targets(ast.parse(src).body[0], module, is_package, known)

    assert named("from ...config import load_config") == ["slurm_resilience.config"]
    assert named("from ..observe import detect") == ["slurm_resilience.supervisor.observe.detect"]
    assert named("from ..observe.detect import Fault") == ["slurm_resilience.supervisor.observe.detect"]
    assert named("from .observe import detect", "slurm_resilience.supervisor", True) == [
        "slurm_resilience.supervisor.observe.detect"]
    assert named("import slurm_resilience.config as c") == ["slurm_resilience.config"]
    assert named("from slurm_resilience import nothing_here") == ["slurm_resilience"]
    assert named("import torch") == []


def test_type_checking_imports_do_not_count_function_imports_do():
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
           "def f():\n    import c\nclass K:\n    import d\ntry:\n    import e\nexcept ImportError:\n    import g\n"
           "if typing.TYPE_CHECKING:\n    import h\n")
    names = [a.name for n in runtime_nodes(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["b", "c", "d", "e", "g"]
