"""A package's import graph, as a reader follows it: every import anywhere in a module (at the top,
in a function, under TYPE_CHECKING), and the parent packages Python runs first (importing
`a.b.c` runs `a` and `a.b`: an import in `a/__init__.py` is a dependency of everything below it).
For the layout tests (tests/server/test_layout.py, tests/operator/test_layout.py)."""

from __future__ import annotations

import ast
from pathlib import Path


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name → file, for every module of the package."""
    out = {}
    for p in package_dir.rglob("*.py"):
        if "__pycache__" in p.parts or "_pb2" in p.name:
            continue
        parts = list(p.relative_to(package_dir.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(package_dir: Path) -> tuple[dict[str, set[str]], list[str]]:
    """→ (module → the package's modules it depends on, relative imports found: each one a
    'module: line' the tests refuse, since a reader cannot see where they lead at a glance)."""
    mods, root = modules(package_dir), package_dir.name
    edges, relative = {}, []
    for name, path in mods.items():
        found = set(parents(name))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                relative.append(f"{name}: line {node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in mods else node.module
                    found.update([target, *parents(target)])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        found.update([alias.name, *parents(alias.name)])
        edges[name] = {m for m in found if m in mods and m != name}
    return edges, relative


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another round (Tarjan's strongly connected components
    of more than one module)."""
    out, index, low, stack, on = [], {}, {}, [], set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                out.append(sorted([v, *component]))

    for m in edges:
        if m not in index:
            visit(m)
    return out
