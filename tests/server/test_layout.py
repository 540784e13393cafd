"""The package tree is the map of the data path: each subpackage of embedserve imports only what
its docstring's "May import:" line allows, and no module imports itself back through others
(function-level and TYPE_CHECKING imports included: a reader follows those too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import embedserve

PKG = Path(embedserve.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts and "_pb2" not in p.name}
SUBPACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "embedserve")


def imports(name: str) -> set[str]:
    """The embedserve modules `name` imports, wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "embedserve":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "embedserve")
    return {m for m in found if m in MODULES and m != name}


def unit(name: str) -> str:
    """The subpackage a module belongs to, or the top-level module itself."""
    return next((p for p in SUBPACKAGES if name == p or name.startswith(p + ".")), name)


def allowed(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    line = re.search(r"^May import: (.+)$", doc, re.M)
    assert line, f"{package}'s docstring says nothing of what it may import"
    return {m.strip() for m in line.group(1).split(",")}


def test_every_subpackage_imports_only_what_its_docstring_allows():
    wrong = [f"{m} imports {i}" for m in MODULES for i in imports(m)
             if unit(m) in SUBPACKAGES and unit(i) != unit(m) and unit(i) not in allowed(unit(m))]
    assert wrong == []


def test_no_import_circle():
    graph = {m: imports(m) for m in MODULES}
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v):  # Tarjan: every strongly connected component of more than one module is a circle
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                circles.append(sorted([v, *component]))

    for m in graph:
        if m not in index:
            visit(m)
    assert circles == []


def test_the_subpackages_are_the_stages():
    assert SUBPACKAGES == ["embedserve.admission", "embedserve.batching", "embedserve.frontends", "embedserve.model",
                           "embedserve.transports"]
