"""The docs stay true to what they describe: README.md is the front door, docs/ the rest.

The configuration pages name exactly the variables the settings objects read; every relative link
and anchor resolves; every repository path and test the pages name exists; the README stays short,
keeps the two commands, and its examples run (the Python ones against a real server, the
EmbeddingService against the CRD's schema)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from embedop import crd, spec as specs
from embedop.config import OperatorSettings
from embedserve.config import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Pages whose named paths are checked too (not linked pages of the docs: the figures).
NAMING = [*PAGES, ROOT / "bench" / "RESULTS.md"]
README_MAX_LINES = 260
# Paths the pages name that a checkout does not hold until a script makes them.
GENERATED = {"bench/wheels"}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.M | re.S)


# -- Settings: the pages name exactly what the code reads.

class _Recording(Mapping):
    """An empty environment that remembers every name looked up in it (get and `in` both go
    through __getitem__)."""

    def __init__(self):
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        raise KeyError(name)

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


def variables_read(settings_class) -> set[str]:
    """The environment variables `settings_class.from_env` reads: the upper-case string literal
    that is the first argument of any call in its source (`s.int("NAME", ...)`, `env.get("NAME")`,
    `positive("NAME", ...)`), which also finds a read behind a condition; cross-checked by running
    it on an empty environment that records every look-up, which also finds a name built at run
    time."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(settings_class.from_env)))
    parsed = {node.args[0].value for node in ast.walk(tree)
              if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]*", node.args[0].value)}
    env = _Recording()
    settings_class.from_env(env)
    assert env.read <= parsed, f"read at run time but not found in the source: {sorted(env.read - parsed)}"
    return parsed | env.read


def table_rows(page: Path, header: str):
    """(line, first cell) of each body row of the page's tables whose first column is `header`."""
    in_table = False
    for line in prose(page):
        if not line.startswith("|"):
            in_table = False
            continue
        first = line.strip("|").split("|")[0].strip()
        if first == header:
            in_table = True
        elif in_table and set(first) - set("-: "):
            yield line, first


def variables_documented(page: Path) -> set[str]:
    """The names in the first column of the page's `| variable | default | meaning |` tables."""
    names = set()
    for line, first in table_rows(page, "variable"):
        found = re.findall(r"`([A-Z][A-Z0-9_]*)`", first)
        assert found, f"{page_id(page)}: a settings row names no `VARIABLE`: {line[:80]}"
        names |= set(found)
    return names


@pytest.mark.parametrize("settings_class, page", [(Settings, "configuration.md"), (OperatorSettings, "operator.md")],
                         ids=["server", "operator"])
def test_the_settings_tables_name_exactly_what_the_settings_read(settings_class, page):
    read, documented = variables_read(settings_class), variables_documented(DOCS / page)
    assert len(read) > 10  # the parse found the reads at all
    assert not read - documented, f"read by {settings_class.__name__}.from_env, missing from docs/{page}: {sorted(read - documented)}"
    assert not documented - read, f"documented in docs/{page}, never read by {settings_class.__name__}: {sorted(documented - read)}"


# -- Links, anchors and paths.

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link and code markup dropped, lower case, every character but
    word characters, hyphens and spaces removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [target for line in prose(page) for target in re.findall(r"\]\(([^)\s]+)\)", line)]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no such heading in {where.relative_to(ROOT)}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    assert not [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert (ROOT / "bench" / "RESULTS.md").resolve() in linked


REPO_PATH = re.compile(r"`((?:server|operator|crds|charts|protos|tests|bench)/[\w./-]*)(?:::[\w.]+)?`")


@pytest.mark.parametrize("page", NAMING, ids=page_id)
def test_every_repository_path_named_exists(page):
    named = {m for line in prose(page) for m in REPO_PATH.findall(line)}
    named |= {m for line in page.read_text().splitlines() for m in REPO_PATH.findall(line)
              if m.startswith("tests/")}
    missing = sorted(p for p in named if p.rstrip("/") not in GENERATED and not (ROOT / p).exists())
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


# A Python name the pages give for the operator's or the server's code: `embedop.kube.Retryable`,
# `kopf.TemporaryError`.
CODE_NAME = re.compile(r"`((?:embedop|embedserve|kopf)(?:\.\w+)+)`")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_name_named_exists_and_kopf_names_are_used(page):
    """A name of our packages resolves (module, then attributes); a kopf name is one the operator
    uses (a page said failures were retried through `kopf.TemporaryError`, which nothing raised)."""
    import importlib

    used = "\n".join(p.read_text() for p in (ROOT / "operator" / "embedop").glob("*.py"))
    wrong = []
    for name in sorted({m for line in prose(page) for m in CODE_NAME.findall(line)}):
        if name.startswith("kopf."):
            if name not in used:
                wrong.append(f"{name} (not used by the operator)")
            continue
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                wrong.append(f"{name} (no such name)")
            break
        else:
            wrong.append(f"{name} (no such module)")
    assert not wrong, f"{page_id(page)} names code that is not there: {wrong}"


def functions_of(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_test_named_exists(page):
    """`tests/x.py::test_name` names a test of that file; `test_name...` one that starts so."""
    missing = []
    for path, name, prefix in re.findall(r"(tests/[\w/]+\.py)::(\w+)(\.\.\.)?", page.read_text()):
        functions = functions_of(ROOT / path) if (ROOT / path).exists() else set()
        if not (any(f.startswith(name) for f in functions) if prefix else name in functions):
            missing.append(f"{path}::{name}{prefix}")
    assert not missing, f"{page_id(page)} names tests that do not exist: {missing}"


def test_the_module_tables_name_every_server_module():
    """docs/architecture.md's `| module | job |` tables: each module named exists, and every module
    of server/embedserve is named (a new module gets a row)."""
    package = ROOT / "server" / "embedserve"
    modules = {p.name for p in package.rglob("*.py") if p.name != "__init__.py" and "_pb2" not in p.name}
    named = set()
    for line, _ in table_rows(DOCS / "architecture.md", "module"):
        named |= set(re.findall(r"`(\w+\.py)`", line))
    assert not named - modules, f"named but not in server/embedserve: {sorted(named - modules)}"
    assert not modules - named, f"server/embedserve modules missing from docs/architecture.md: {sorted(modules - named)}"


# -- The README: short, the two commands, examples that work.

def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "the README is the front door: move detail to docs/"
    commands = [line.split("#")[0].strip() for block in code_blocks(README, "sh") for line in block.splitlines()]
    assert "make serve" in commands and "make test" in commands


def readme_python(needle: str) -> str:
    (block,) = [b for b in code_blocks(README, "python") if needle in b]
    return block


def test_the_readme_grpc_example_runs(default_server):
    code = readme_python("embedserve.client").replace("localhost:50051", default_server.target)
    assert code != readme_python("embedserve.client")
    exec(compile(code, "README.md (gRPC example)", "exec"), {"__name__": "readme"})


def test_the_readme_openai_example_runs(default_server):
    code = readme_python("from openai").replace("http://localhost:8001", default_server.http)
    assert code != readme_python("from openai")
    exec(compile(code, "README.md (OpenAI example)", "exec"), {"__name__": "readme"})


def test_the_readme_embeddingservice_is_valid_against_the_crd():
    import jsonschema  # noqa: PLC0415 - only this test validates manifests

    from tests.operator.test_crd import cel_errors, strict  # noqa: PLC0415

    (block,) = [b for b in code_blocks(README, "sh") if "kind: EmbeddingService" in b]
    manifest = yaml.safe_load(block.split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0])
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(manifest, strict(schema))
    defaulted = specs.defaulted(manifest["spec"])
    assert cel_errors(defaulted, schema["properties"]["spec"]) == []
    assert specs.problems(defaulted) == []
