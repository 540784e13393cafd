"""The package tree is the map of the data path. The stages are layers: each module imports only
modules of lower layers (and of its own unit); each subpackage imports only what its docstring's
"May import:" line allows; no module imports itself back through others; no relative import.
Imports are read as a reader follows them (tests/imports.py): function-level and TYPE_CHECKING
ones too, and the parent packages Python runs first."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import embedserve
from tests.imports import circles, graph, modules

PKG = Path(embedserve.__file__).parent
MODULES = modules(PKG)
EDGES, RELATIVE = graph(PKG)
SUBPACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "embedserve")
# Lowest first: what a layer may import is below it. The request flows down (transports call the
# service, which admits and batches, which runs the model); what wires the stages sits on top.
LAYERS = [
    {"embedserve.env_reader", "embedserve.errors"},
    {"embedserve.model_list"},  # MODELS: read by config, addressed by both kinds of process
    {"embedserve", "embedserve.config", "embedserve.threads", "embedserve.lifecycle",
     "embedserve.client_routing", "embedserve.tracing", "embedserve.logs"},
    # The Client is no stage of the server: its decisions, its pods, and the façade over both.
    {"embedserve.client_pods", "embedserve.client_retries"},
    {"embedserve.client_calls"},
    {"embedserve.client_metadata"},
    {"embedserve.client"},
    {"embedserve.model", "embedserve.admission"},
    {"embedserve.batching"},
    {"embedserve.service"},
    {"embedserve.metrics"},
    {"embedserve.transports"},
    {"embedserve.calibrate"},
    {"embedserve.frontends", "embedserve.prepare"},
    {"embedserve.prefetch"},
    {"embedserve.model_stack"},  # one model of the pod, from its files to its service
    {"embedserve.app"},
    {"embedserve.__main__"},
]


def unit(name: str) -> str:
    """The subpackage a module belongs to, or the top-level module itself."""
    return next((p for p in SUBPACKAGES if name == p or name.startswith(p + ".")), name)


def layer(name: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit(name) in units)


def allowed(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    line = re.search(r"^May import: (.+)$", doc, re.M)
    assert line, f"{package}'s docstring says nothing of what it may import"
    return {m.strip() for m in line.group(1).split(",")}


def test_every_module_has_a_layer():
    assert all(any(unit(m) in units for units in LAYERS) for m in MODULES), \
        [m for m in MODULES if not any(unit(m) in units for units in LAYERS)]


def test_every_module_imports_only_from_the_layers_below():
    wrong = [f"{m} imports {i}" for m, imports in EDGES.items() for i in imports
             if unit(i) != unit(m) and i != "embedserve" and layer(i) >= layer(m)]
    assert wrong == []


def test_every_subpackage_imports_only_what_its_docstring_allows():
    wrong = [f"{m} imports {i}" for m, imports in EDGES.items() for i in imports
             if unit(m) in SUBPACKAGES and unit(i) != unit(m) and i != "embedserve" and unit(i) not in allowed(unit(m))]
    assert wrong == []


def test_no_import_circle_and_no_relative_import():
    assert circles(EDGES) == [] and RELATIVE == []


def test_the_subpackages_are_the_stages():
    assert SUBPACKAGES == ["embedserve.admission", "embedserve.batching", "embedserve.frontends", "embedserve.model",
                           "embedserve.transports"]


def test_what_start_up_checks_before_the_front_ends_imports_no_prometheus_client():
    """__main__ checks the key and certificate files (auth, tls) before it sets
    PROMETHEUS_MULTIPROC_DIR for FRONTENDS > 1; prometheus_client imported before that counts the
    model process's batches in memory only, and every front end's /metrics says 0 real tokens."""
    import subprocess
    import sys

    code = ("import sys; import embedserve.__main__, embedserve.transports.auth, embedserve.transports.tls; "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
