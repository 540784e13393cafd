"""API keys: who may call (API_KEYS, API_KEYS_FILE). Installed only when a key is configured:
without one, no interceptor and no middleware is in any request's path.

With keys, every route of the API port and every gRPC method needs `Authorization: Bearer <key>`
(HTTP header; gRPC metadata `authorization`), as TEI's --api-key and OpenAI's API take it, so
the openai client (`api_key=`), huggingface_hub (`token=`) and our Client (`api_key=`) work
unchanged. Deny by default: a route or method added later is guarded without a word here. Open:
grpc.health.v1 (kubelet's gRPC probe, grpc-health-probe and meshes send no key) and server
reflection (grpcurl; it tells the schema, not the model); the metrics port is plain and keyless
altogether (transports/metrics_port.py says why).

A key is compared in constant time: the presented key and every configured one are SHA-256
digests (equal length, whatever was sent), compared with hmac.compare_digest against every key,
no early exit. Refusals count in embedfleet_auth_refusals_total{reason}; no key, presented or
configured, is ever logged or exported."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Callable

import grpc

from embedserve.config import ConfigError, Settings
from embedserve.transports import outcomes
from embedserve.transports.reloads import Watched

log = logging.getLogger(__name__)

MESSAGES = {"missing": "missing API key: send Authorization: Bearer <key>", "invalid": "invalid API key"}
# RFC 6750: a request without credentials gets the bare challenge, a wrong token its error code.
CHALLENGES = {"missing": b"Bearer", "invalid": b'Bearer error="invalid_token"'}
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                "/grpc.reflection.v1.ServerReflection/")


def numbered_keys(text: str) -> tuple[tuple[int, str], ...]:
    """An API_KEYS_FILE's keys with their line numbers (from 1): one a line; blank lines and lines
    starting with # left out."""
    lines = ((n, line.strip()) for n, line in enumerate(text.splitlines(), 1))
    return tuple((n, line) for n, line in lines if line and not line.startswith("#"))


def doubtful_lines(numbered: tuple[tuple[int, str], ...]) -> list[int]:
    """Lines whose key holds a comma or whitespace, neither of which a Bearer token has (RFC 6750's
    b64token): most likely keys written the API_KEYS way ("k1,k2"), which the file takes as ONE
    key that no client sends, so every client would get "invalid API key" with nothing saying why."""
    return [n for n, key in numbered if "," in key or any(c.isspace() for c in key)]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (the scheme in any case, RFC 7235), or
    None: absent, empty, or another scheme."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class ApiKeys:
    """The keys this server takes: API_KEYS' (fixed) and API_KEYS_FILE's (read again when the file
    changes: `reload`, from the transports' reload task). `refused(reason)` counts a refusal."""

    def __init__(self, fixed: tuple[str, ...], path: str, refused: Callable[[str], None] = lambda reason: None):
        self.path, self._refused = path, refused
        self._fixed = frozenset(_digest(k) for k in fixed)
        self._watched = Watched([path]) if path else None
        from_file = self._read() if path else frozenset()
        if path and not from_file:
            raise ConfigError(f"API_KEYS_FILE={path!r} holds no key (one a line; # starts a comment)")
        self._digests = tuple(self._fixed | from_file)

    def _read(self) -> frozenset[bytes]:
        with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
            numbered = numbered_keys(f.read())
        if doubtful := doubtful_lines(numbered):  # by line number: the key itself is never logged
            log.warning("API_KEYS_FILE %s, %s %s: a key with a comma or whitespace in it, taken whole as one key "
                        "(the file has one key a line: put each on a line of its own)", self.path,
                        "lines" if len(doubtful) > 1 else "line", ", ".join(map(str, doubtful)))
        return frozenset(_digest(k) for _, k in numbered)

    def reload(self) -> None:
        """Read API_KEYS_FILE again if it changed. Unreadable, or holding no key (a Secret caught
        mid-edit, a mount gone): the keys stay as they were, with a warning; never an open server."""
        if self._watched is None or not self._watched.changed():
            return
        try:
            from_file = self._read()
        except OSError as e:
            log.warning("API_KEYS_FILE %s cannot be read (%s): keeping the %d keys read before", self.path,
                        e.strerror or e, len(self._digests))
            return
        if not from_file:
            log.warning("API_KEYS_FILE %s holds no key now: keeping the %d keys read before", self.path,
                        len(self._digests))
            return
        self._digests = tuple(self._fixed | from_file)
        log.info("API_KEYS_FILE %s read again: %d keys", self.path, len(self._digests))

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` carries one of the keys; else the refusal's reason, counted:
        "missing" or "invalid". Every key is compared, whichever matches (constant time)."""
        key = bearer(authorization)
        if key is None:
            self._refused("missing")
            return "missing"
        presented, match = _digest(key), False
        for known in self._digests:
            match |= hmac.compare_digest(known, presented)
        if match:
            return None
        self._refused("invalid")
        return "invalid"


def from_settings(settings: Settings, refused: Callable[[str], None] = lambda reason: None) -> ApiKeys | None:
    """The configured keys, or None (no key: nothing to check, nothing installed). Raises
    ConfigError, naming the variable, for a file that holds none."""
    if not settings.api_keys and not settings.api_keys_file:
        return None
    return ApiKeys(settings.api_keys, settings.api_keys_file, refused)


class GrpcKeys(grpc.aio.ServerInterceptor):
    """Every method but OPEN_METHODS' needs the key in the `authorization` metadata; without it
    the call ends UNAUTHENTICATED before its request is even decoded."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        authorization = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        reason = self.keys.check(authorization if isinstance(authorization, str) else None)
        if reason is None:
            return handler
        outcomes.grpc_refused(details.method, grpc.StatusCode.UNAUTHENTICATED, MESSAGES[reason],
                              details.invocation_metadata)  # its line (never the key) and span
        return _refusal(handler, MESSAGES[reason])


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the refused method's kind that ends the call UNAUTHENTICATED (no
    deserializer: the request's bytes are never decoded)."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class HttpKeys:
    """ASGI middleware: every request needs the key (every route, the OpenAPI document and the
    docs pages included); without it, 401 with `WWW-Authenticate: Bearer` and an OpenAI-style
    error body (the openai client raises AuthenticationError on it)."""

    def __init__(self, app, keys: ApiKeys, api_paths: frozenset[str] = frozenset()):
        self.app, self.keys = app, keys
        self.api_paths = api_paths  # paths whose refusals get a span (http_api.API_PATHS)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        # The header's bytes as the key file's (UTF-8): a key compares byte for byte either way.
        reason = self.keys.check(None if authorization is None else authorization.decode("utf-8", "surrogateescape"))
        if reason is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": MESSAGES[reason]})
        body = json.dumps({"error": {"message": MESSAGES[reason], "type": "authentication_error",
                                     "code": f"{reason}_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", CHALLENGES[reason])]})
        await send({"type": "http.response.body", "body": body})
        outcomes.http_refused(scope, 401, MESSAGES[reason], self.api_paths)  # its line (never the key) and span
