"""The package's layers, checked on the source (``ast``; nothing is imported).

The supervisor is split by role; each layer may import only what the table says
(``docs/architecture.md``, "Layout", has the same table):

    layer                       may import (inside slurm_resilience.supervisor)
    supervisor.decide           decide                     pure: no I/O modules
    supervisor.adapters         decide, adapters
    supervisor.observe          decide, adapters, observe
    supervisor.executors        decide, adapters, observe, executors

Around it: the entry layer (``cli``, ``launch``) starts the supervisor and is the
only part of the package that may import it; the supervisor never imports the
entry layer. Every import counts: module level, inside functions, and under
``if TYPE_CHECKING:`` (an annotation still ties two modules together), and no
two modules may import each other, even only for types.
"""

from __future__ import annotations

import ast

from importgraph import PACKAGE, describe, find_cycles, import_graph, is_type_checking, modules

SUP = f"{PACKAGE}.supervisor"

# layer -> the supervisor layers it may import
ALLOWED = {
    "decide": {"decide"},
    "adapters": {"decide", "adapters"},
    "observe": {"decide", "adapters", "observe"},
    "executors": {"decide", "adapters", "observe", "executors"},
}
# what a pure layer must not import (files, clock, processes, sockets, threads, torch)
IMPURE = ("os", "time", "subprocess", "socket", "selectors", "threading", "multiprocessing", "signal", "torch")
PURE_LAYERS = {"decide"}
# the only parts of the package that may import the supervisor (they start it)
ENTRY = (f"{PACKAGE}.cli", f"{PACKAGE}.launch")


def _all_nodes(tree: ast.AST):
    """Every node, ``if TYPE_CHECKING:`` bodies and function bodies included."""
    return ast.walk(tree)


def full_graph() -> dict[str, dict[str, int]]:
    """module → {package module it imports: line}, every import counted."""
    return import_graph(_all_nodes)


def external_imports(module: str) -> dict[str, int]:
    """Top-level names of the modules outside the package that ``module`` imports: line."""
    path = modules()[module]
    out: dict[str, int] = {}
    for node in _all_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if not name.startswith(PACKAGE):
                out.setdefault(name, node.lineno)
    return out


def layer_of(module: str) -> str | None:
    """``decide`` / ``observe`` / ``executors`` / ``adapters`` for a supervisor module."""
    if not module.startswith(SUP + "."):
        return None
    return module[len(SUP) + 1:].split(".")[0]


def violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import the table forbids, as 'module (line N) imports target: why'."""
    bad = []
    for mod, edges in sorted(graph.items()):
        mine = layer_of(mod)
        for target, line in sorted(edges.items()):
            theirs = layer_of(target)
            where = f"{mod} (line {line}) imports {target}"
            if mine is not None and theirs is not None and theirs not in ALLOWED[mine]:
                bad.append(f"{where}: {mine} may import only {', '.join(sorted(ALLOWED[mine]))}")
            if (mod == SUP or mine) and target.startswith(ENTRY):
                bad.append(f"{where}: the supervisor does not import the entry layer (cli, launch)")
            if (target == SUP or theirs) and not (mod == SUP or mine) and not mod.startswith(ENTRY):
                bad.append(f"{where}: only the entry layer (cli, launch) imports the supervisor")
    return bad


def test_every_supervisor_module_has_a_layer():
    stray = [m for m in modules() if m.startswith(SUP + ".") and layer_of(m) not in ALLOWED]
    assert not stray, f"supervisor modules outside decide/observe/executors/adapters: {stray}"


def test_layers_import_only_what_the_table_allows():
    bad = violations(full_graph())
    assert not bad, "layering broken:\n  " + "\n  ".join(bad)


def test_decide_is_pure():
    bad = []
    for mod in modules():
        if layer_of(mod) in PURE_LAYERS:
            for name, line in external_imports(mod).items():
                if name.split(".")[0] in IMPURE:
                    bad.append(f"{mod} (line {line}) imports {name}")
    assert not bad, "pure layer imports I/O: " + ", ".join(bad)


def test_no_import_cycle_type_only_imports_included():
    graph = full_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (every import counted):\n  " + "\n  ".join(
        describe(graph, c) for c in cycles)


# The checker itself, on made-up graphs.

def test_violations_catch_each_rule():
    graph = {
        f"{SUP}.decide.a": {f"{SUP}.observe.b": 3},               # decide may not import observe
        f"{SUP}.observe.b": {f"{SUP}.executors.c": 4},            # observe may not import executors
        f"{SUP}.adapters.d": {f"{SUP}.decide.a": 5, f"{PACKAGE}.launch.x": 6},  # decide ok; launch not
        f"{PACKAGE}.worker.w": {f"{SUP}.decide.a": 7},             # only the entry layer
        f"{PACKAGE}.launch.x": {f"{SUP}.executors.c": 8},          # the entry layer may
        f"{SUP}.executors.c": {f"{SUP}.observe.b": 9},
    }
    assert [v.split(":")[0] for v in violations(graph)] == [
        f"{SUP}.adapters.d (line 6) imports {PACKAGE}.launch.x",
        f"{SUP}.decide.a (line 3) imports {SUP}.observe.b",
        f"{SUP}.observe.b (line 4) imports {SUP}.executors.c",
        f"{PACKAGE}.worker.w (line 7) imports {SUP}.decide.a",
    ]


def test_type_checking_and_function_imports_count():
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    import b\n"
    names = [a.name for n in _all_nodes(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["a", "b"] and is_type_checking(ast.parse("TYPE_CHECKING").body[0].value)
