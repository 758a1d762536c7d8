"""The package's import graph: no module imports, directly or through others, a module that imports it back, at
run time (imports inside functions count; those under ``TYPE_CHECKING`` do not), so that data flows one way; and
the engine never names ``SelfReplay``: replay reaches it as samples (:mod:`hf_janus.replay.resolve`)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_janus

PACKAGE = Path(hf_janus.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("hf_janus",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def run_time_imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports when it runs: ``from a.b import c`` is ``a.b.c`` when that is a module,
    else ``a.b``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for branch in ast.walk(tree)
                   if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                   for statement in branch.body for node in ast.walk(statement)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_janus"):
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    return out & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    known = modules()
    graph = {name: run_time_imports(path, set(known)) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_walk_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_never_names_self_replay():
    named = [str(p) for p in (PACKAGE / "engine").rglob("*.py") if "SelfReplay" in p.read_text(encoding="utf-8")]
    assert named == []


def test_the_layers_below_evaluation_never_import_it():
    """The engine, the adapters and publishing sit below the evaluation harness: what a card prints of a frontier
    comes with the frontier's record, not from the harness's code."""
    known = modules()
    below = ("hf_janus.engine", "hf_janus.adapters", "hf_janus.publish", "hf_janus.replay")
    crossing = {name: sorted(m for m in run_time_imports(path, set(known)) if m.startswith("hf_janus.evaluation"))
                for name, path in known.items() if name.startswith(below)}
    assert {name: found for name, found in crossing.items() if found} == {}
