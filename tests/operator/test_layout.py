"""embedop is flat (its docstring says why), but no module of it imports itself back through
others either, and none imports relatively (tests/imports.py reads imports as a reader does)."""

from pathlib import Path

import embedop
from tests.imports import circles, graph


def test_no_import_circle_and_no_relative_import():
    edges, relative = graph(Path(embedop.__file__).parent)
    assert circles(edges) == [] and relative == []
