"""embedop is flat (its docstring says why), but no module of it imports itself back through
others either, and none imports relatively (tests/imports.py reads imports as a reader does)."""

from pathlib import Path

import embedop
from tests.imports import circles, graph


def test_no_import_circle_and_no_relative_import():
    edges, relative = graph(Path(embedop.__file__).parent)
    assert circles(edges) == [] and relative == []


def test_the_docstring_lists_every_module_and_counts_them():
    import re

    modules = {p.stem for p in Path(embedop.__file__).parent.glob("*.py")} - {"__init__"}
    listed = set(re.findall(r"^  (\w+)\s", embedop.__doc__, re.M))
    assert listed == modules, (modules - listed, listed - modules)
    words = {23: "twenty-three", 24: "twenty-four", 25: "twenty-five", 26: "twenty-six", 27: "twenty-seven",
             28: "twenty-eight", 29: "twenty-nine", 30: "thirty", 31: "thirty-one", 32: "thirty-two",
             33: "thirty-three", 34: "thirty-four", 35: "thirty-five"}
    assert f" {words[len(modules)]} modules" in embedop.__doc__
