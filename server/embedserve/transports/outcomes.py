"""What a request leaves behind besides its metrics, for gRPC and HTTP alike: its span
(embedserve.tracing: begun as it arrives, when tracing is on) and its log line (embedserve.logs:
refused or failed, and served with ACCESS_LOG). The transports call `*_begin` only when
`tracing.tracer` is set, and `*_end` only when there is a span to end or a line to write, so a
served request with both off pays two checks."""

from __future__ import annotations

from http import HTTPStatus

from embedserve import logs, tracing

REASON_KEY = "embedfleet.reason"  # the message an HTTP error answered with (ASGI scope), for its line and span
QUIET_PATHS = frozenset(("/health", "/metrics"))  # probes and scrapes: no request lines


def _metadata(metadata, key: str) -> str | None:
    return next((v for k, v in metadata or () if k == key), None)


REFUSAL = "embedfleet.refusal"  # why a request was refused (its span's status stays unset)


def _outcome(attributes: dict, reason: str, answered_error: bool, server_error: bool) -> tuple[dict, str | None]:
    """(span attributes, error status message or None). OpenTelemetry's conventions for server
    spans: only the server's own failures are errors (gRPC's INTERNAL, UNAVAILABLE, ... ; HTTP
    5xx); a refusal (bad input, overload, no key: 4xx, INVALID_ARGUMENT, RESOURCE_EXHAUSTED) is the
    caller's outcome, so span-derived error rates do not count it; its reason is an attribute."""
    if not answered_error:
        return attributes, None
    if server_error:
        return attributes, reason
    return {**attributes, REFUSAL: reason[:tracing.REASON_CHARS]}, None


def grpc_begin(service: str, rpc: str, metadata) -> tracing.Recorder | None:
    carrier = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate")}
    return tracing.begin(f"{service}/{rpc}", carrier, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc})


def grpc_end(rpc: str, code, duration_s: float, reason: str, rec: tracing.Recorder | None, metadata,
             bug: bool = False) -> None:
    """An RPC's end: `code` a grpc.StatusCode, `reason` the message it was answered with, `bug`:
    an exception no status maps (INTERNAL, logged as an error)."""
    failed = code.name != "OK"
    if rec is not None:
        tracing.finish(rec, *_outcome({"rpc.grpc.status_code": code.value[0]}, reason or code.name,
                                      failed, bug or code.name in logs.FAILED_GRPC))
    level = logs.grpc_level(code.name, bug)
    if level is not None:
        trace_id = tracing.trace_id(rec) or tracing.traceparent_trace_id(_metadata(metadata, "traceparent"))
        logs.request_line({"rpc": rpc}, code.name, duration_s, reason, trace_id, level)


# OpenTelemetry's HTTP conventions: a method outside these is `_OTHER` (its own token kept in
# http.request.method_original), so a caller cannot mint span names.
HTTP_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"))


def http_begin(request, path: str) -> tracing.Recorder | None:
    """The request's span; its Recorder waits in the ASGI scope for the route's Caller."""
    method = request.method
    attributes = {"http.request.method": method, "http.route": path, "url.path": path}
    if method not in HTTP_METHODS:
        attributes.update({"http.request.method": "_OTHER", "http.request.method_original": method[:64]})
        method = "HTTP"
    rec = tracing.begin(f"{method} {path}", request.headers, attributes)
    request.scope[tracing.SCOPE_KEY] = rec
    return rec


def note(request, reason: str) -> None:
    """The message an HTTP error answers with, for its log line and span (error path only)."""
    request.scope[REASON_KEY] = reason


def noted_validation(request, errors: list[dict]) -> None:
    """A 422's reason: how many errors, and the first (its location and message, not its input)."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    note(request, f"the body does not match the schema ({len(errors)} errors): {where}: {first.get('msg', '')}")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return str(status)


def http_end(request, path: str, status: int, duration_s: float, rec: tracing.Recorder | None,
             bug: BaseException | None = None) -> None:
    """An HTTP request's end (`bug`: an exception the error handlers do not map, answered 500)."""
    failed = status >= 400
    reason = ""
    if failed:
        reason = request.scope.get(REASON_KEY) or (f"{type(bug).__name__}: {bug}" if bug is not None else
                                                   _phrase(status))
    if rec is not None:
        tracing.finish(rec, *_outcome({"http.response.status_code": status}, reason, failed,
                                      status >= 500 or bug is not None))
    if path in QUIET_PATHS:
        return
    level = logs.http_level(status, bug is not None)
    if level is not None:
        trace_id = tracing.trace_id(rec) or tracing.traceparent_trace_id(request.headers.get("traceparent"))
        logs.request_line({"method": request.method, "route": path}, status, duration_s, reason, trace_id, level)


def grpc_refused(method: str, code, reason: str, metadata) -> None:
    """A call refused before its servicer ran (transports/auth.py: no or a wrong API key): its span
    and line as any other refusal's. `method`: gRPC's full name, /package.Service/Method."""
    service, _, rpc = method.lstrip("/").rpartition("/")
    rec = grpc_begin(service, rpc, metadata) if tracing.tracer is not None else None
    grpc_end(rpc, code, 0.0, reason, rec, metadata)


def http_refused(scope, status: int, reason: str, api_paths: frozenset[str]) -> None:
    """An HTTP request refused before routing (auth.py). A span only for the API's own paths: a
    refused request's path is the caller's choice, and span names must not be."""
    from starlette.requests import Request  # the refusal path only

    request, path = Request(scope), scope["path"]
    rec = http_begin(request, path) if tracing.tracer is not None and path in api_paths else None
    note(request, reason)
    http_end(request, path, status, 0.0, rec)
