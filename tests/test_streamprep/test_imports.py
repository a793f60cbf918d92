"""The import graph of our packages (streamprep, quality): no cycle, counting imports inside functions and under
TYPE_CHECKING (`from pkg import submodule` is an edge to the submodule), config.py a leaf, and an import of ours
inside a function only to defer an optional heavy dependency, which its comment names (MARKER)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO as ROOT
PACKAGES = ("streamprep", "quality")
# the comment on a function-body import of ours names the heavy optional dependency it defers
MARKER = re.compile(r"#.*\b(ray|xenna|torch)\b", re.IGNORECASE)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports anywhere in its body."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[m].update(r for r in map(resolve, targets) if r and r != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_among_our_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_is_a_leaf_and_the_registry_imports_nothing_of_ours() -> None:
    graph = import_graph()
    assert graph["streamprep.config"] == {"streamprep.registry"}
    assert graph["streamprep.registry"] == set()


def unmarked_function_imports(source: str) -> list[int]:
    """Lines of imports of our modules inside a function whose line carries no MARKER comment."""
    lines = source.splitlines()
    out = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." if node.level else node.module or ""]
            else:
                continue
            ours = any(n == "." or n.split(".")[0] in PACKAGES for n in names)
            if ours and not any(MARKER.search(lines[i - 1]) for i in range(node.lineno, node.end_lineno + 1)):
                out.add(node.lineno)
    return sorted(out)


def test_a_function_body_import_of_ours_only_defers_ray_xenna_or_torch() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(_modules().values())
             for n in unmarked_function_imports(p.read_text())]
    assert not found, ("imports of our modules inside a function, without a comment naming the Ray, Xenna or torch "
                       "import they defer (move them to the top of the module): " + ", ".join(found))


def test_the_marker_check_finds_an_unmarked_import() -> None:
    source = """
import ray
from streamprep import config


def a():
    import numpy
    from streamprep import layout
    from . import units
    from streamprep.engines import xenna_stage  # Xenna: imports cosmos_xenna
    from quality import (  # torch, for the model
        control)
    from streamprep import arrays  # arrays of torches: "array" and "torches" are not the names
"""
    assert unmarked_function_imports(source) == [8, 9, 13]
