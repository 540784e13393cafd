"""The API's routes as the server builds them, found from the app itself (never a list), and the
worst bodies a route's own schema allows: what the key walk (test_keys_and_tls) and the route
budget (test_route_budget) send to every route, present and future."""

from __future__ import annotations

import functools
import itertools
import json

import starlette.routing

TASKS = ("embed", "classify", "rerank", "sparse", "multivector", "bgem3")


def walk(routes, prefix: str = ""):
    """(path, method, endpoint) of a route table, into included routers (FastAPI keeps them
    nested); the endpoint by its qualified name (another task's refusal is not the task's route)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from walk(route.original_router.routes, prefix + route.include_context.prefix)
        else:
            assert not isinstance(route, starlette.routing.Mount), route  # a mount would need walking too
            name = getattr(route.endpoint, "__qualname__", repr(route.endpoint))
            yield from ((prefix + route.path, method, name) for method in route.methods)


# A pod of several models (MODELS): its models' names and tasks, an embedder the default. Its
# routes are the default's at the root, the others' payload-named ones, and each one's under
# /models/<name>/ (transports/http_models.py).
SHARED = (("dense", "embed"), ("ranker", "rerank"))


async def api_routes(tasks=TASKS) -> dict[str, set[tuple[str, str, str]]]:
    """task → (path, method, endpoint) of every route the API port has for it: the app as the
    server builds it, with the routes installed after warm-up (/openapi.json and the docs pages
    included). "shared" in `tasks`: a pod of the SHARED models."""
    import json

    from embedserve.app import Server
    from embedserve.config import Settings
    from embedserve.transports import http_api, http_server
    from tests.conftest import TEST_BATCH_CAPS

    base = {"BATCH_CAPS": TEST_BATCH_CAPS, "WARM_START": "false"}
    routes = {}
    for task in tasks:
        shared = task == "shared"
        env = {"MODELS": json.dumps([{"name": name, "model": "sim:50000"} for name, _ in SHARED])} if shared \
            else {"MODEL_PATH": "sim:50000"}
        hub = Server(Settings.from_env({**env, **base}), listen=False)
        await hub.start()
        try:
            for model, served in zip(hub.models.values(), [t for _, t in SHARED] if shared else [task]):
                model.task, model.labels = served, ["a", "b"]
            app = http_server.build_app(hub)
            http_api.install_routes(app, hub)
            routes[task] = set(walk(app.routes))
        finally:
            await hub.stop(grace=0)
    return routes


# --- The worst bodies a route's schema allows -------------------------------------------------

class Fill:
    """How a generated body fills what its schema leaves open: strings of `chars` characters of
    `char` (escaped by JSON when outside ASCII), arrays at their most items, integers at their
    maximum, booleans `flag`, and the served model's name where a `model` is asked for."""

    def __init__(self, chars: int, char: str = "é", flag: bool = True, model: str = "", most: int = 512):
        self.chars, self.char, self.flag, self.model, self.most = chars, char, flag, model, most


def _resolve(schema: dict, doc: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = doc["components"]["schemas"][name]
    return schema


def instances(schema: dict, doc: dict, fill: Fill, name: str = "") -> list:
    """Every instance the schema's unions allow, one union member at a time (the others at their
    first), each filled as `fill` says."""
    schema = _resolve(schema, doc)
    members = schema.get("anyOf") or schema.get("oneOf")
    if members:
        out = []
        for member in members:
            if _resolve(member, doc).get("type") != "null":
                out += instances(member, doc, fill, name)
        return out or [None]
    if "enum" in schema:
        return [next((v for v in schema["enum"] if v is not None), None)]
    kind = schema.get("type")
    if kind == "object":
        fields = {k: instances(v, doc, fill, k) for k, v in (schema.get("properties") or {}).items()}
        base = {k: v[0] for k, v in fields.items()}
        out = [base]
        for k, values in fields.items():
            out += [{**base, k: v} for v in values[1:]]
        return out
    if kind == "array":
        most = min(schema.get("maxItems", fill.most), fill.most * 16)
        return [[item] * most for item in instances(schema.get("items", {}), doc, fill, name)]
    if kind == "string":
        if name == "model":
            return [fill.model]
        return [(fill.char * fill.chars)[: schema.get("maxLength", fill.chars)]]
    if kind == "integer":
        return [schema.get("maximum", 2**31 - 1)]
    if kind == "number":
        return [1.0]
    if kind == "boolean":
        return [fill.flag]
    return [{}]


def schema_bodies(doc: dict, path: str, fill: Fill) -> list[bytes]:
    """The route's bodies from its OpenAPI request schema (none: it takes no body), deduplicated;
    characters outside ASCII escaped (\\uXXXX) unless the fill's are astral (sent as raw UTF-8)."""
    operation = doc["paths"].get(path, {}).get("post")
    if not operation or "requestBody" not in operation:
        return []
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    out = []
    for value in instances(schema, doc, fill):
        body = _dumps(value, ord(fill.char) < 0x10000).encode()
        if body not in out:
            out.append(body)
    return out


def _dumps(value, ascii_only: bool) -> str:
    """json.dumps's text, with an array of one item repeated (as instances() makes them) encoded
    once: millions of token ids cost a join, not the encoder's walk (seconds each)."""
    if isinstance(value, list):
        if value and all(item is value[0] for item in value):
            return "[" + ", ".join([_dumps(value[0], ascii_only)] * len(value)) + "]"
        return "[" + ", ".join(_dumps(item, ascii_only) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=ascii_only)}: {_dumps(v, ascii_only)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=ascii_only)


@functools.lru_cache(maxsize=4)
def hostile_bodies(size: int, items: int) -> dict[str, bytes]:
    """Bodies no schema allows, each its own kind of cost to a parser: as many items as a route's
    budget lets through (`items` JSON items) and as many as its bytes hold (`size`)."""
    out = {}
    for bound, most in (("at the items", lambda per: max(1, min(items - 16, (size - 64) // per))),
                        ("filling the bytes", lambda per: max(1, (size - 64) // per))):
        out.update({f"{kind}, {bound}": body for kind, body in (
            ("empty lists", b"[" + b",".join(itertools.repeat(b"[]", most(3))) + b"]"),
            ("one-character strings", b'{"input":[' + b",".join(itertools.repeat(b'"a"', most(4))) + b"]}"),
            ("repeated keys", b"{" + b",".join(itertools.repeat(b'"inputs":"a"', most(13))) + b"}"),
            ("nesting", b"[" * most(2) + b"]" * most(2)),
            ("small ints", b'{"ids":[' + b",".join(itertools.repeat(b"7", most(2))) + b"]}"),
        )})
    return {**out,
            "a long number": b'{"inputs":' + b"9" * (size - 64) + b"}",
            "one string": json.dumps({"inputs": "x" * (size - 64)}).encode(),
            "commas in a string": json.dumps({"inputs": ["a," * ((size - 64) // 2)]}).encode()}
