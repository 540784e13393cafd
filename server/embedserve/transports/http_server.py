"""HTTP transport on HTTP_HEALTH_PORT: GET /health, GET /metrics, and the JSON API of http_api
(uvicorn in our event loop; OpenAPI at /openapi.json), behind the API key and TLS when those are
on (transports/auth.py, tls.py). The same server class serves the metrics port
(transports/metrics_port.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import time
from typing import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from embedserve import __version__
from embedserve.transports import addresses, budget, http_api, http_models, outcomes
from embedserve.transports.http_protocol import SlicedH11Protocol
from embedserve.metrics import CONTENT_TYPE
from embedserve.transports.hub import Hub
from embedserve.transports.request_cycle import RequestCycle



def build_app(server: Hub) -> FastAPI:
    # A body over HTTP_MAX_BODY_BYTES, or its route's budget, is refused with 413 before it is
    # parsed, by budget.BodyBudget (at once on its Content-Length, else as the bytes arrive).
    # FastAPI's own OpenTelemetry off: a request's span is embedserve.tracing's (with its stages);
    # FastAPI's would be a second server span per request wherever a global provider is set
    # (opentelemetry-instrument), and off it does not look for one on every request.
    app = FastAPI(title="embedfleet server", version=__version__,
                  telemetry={"tracing": False, "metrics": False, "logs": False})

    @app.get("/health")
    async def health() -> JSONResponse:
        """The shared signal and readiness; 503 while starting, draining, or failing batches."""
        return await health_response(server)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await metrics_response(server)

    http_api.register(app, server)
    # Innermost first: a body is read against its route's budget before the routes parse it; the
    # request's cycle (its metrics, line, span; 503 while warming up; cancelled when its caller
    # leaves) is around that, so a 413 is counted and logged as any refusal.
    app.state.budgets = {}  # path → budget.Budget, set as the model's routes are installed
    app.add_middleware(budget.BodyBudget, budgets=lambda: app.state.budgets, refused=_noted,
                       read_s=server.settings.http_body_timeout_s, body_cap=server.settings.http_max_body_bytes)
    paths, served = http_api.api_paths(server), http_models.names(server)
    app.add_middleware(RequestCycle, starting=lambda request: http_api.starting(request, server, paths),
                       finished=server.metrics.request_finished, api_paths=paths,
                       observed=http_models.api_paths(http_api.OBSERVED_PATHS, served), busy=http_api.busy,
                       most=server.settings.max_concurrent_requests,
                       model_of=lambda scope: http_models.model_of(scope, served, server.served_name))
    return app


def _noted(scope, reason: str) -> None:
    """A refusal's reason, for its line and span (outcomes.note's, from the scope alone)."""
    scope[outcomes.REASON_KEY] = reason


async def health_response(server: Hub) -> JSONResponse:
    await server.refresh()
    return JSONResponse(server.health_fields(), status_code=200 if server.healthy else 503)


async def metrics_response(server: Hub) -> Response:
    await server.refresh()
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


class ConnectionAge:
    """ASGI middleware: the first response after a keep-alive connection is `max_age_s` old, and
    every response while the server drains, says `Connection: close`. HTTP clients (the openai
    client's pool, say) keep connections for ever, and behind a ClusterIP Service a connection is
    one pod: without an age, pods added by a scale-up never see those clients; without the close
    on draining, a client's retry of the draining pod's 503 goes down the same connection to the
    same pod. A connection is known by its peer address and port."""

    def __init__(self, app, max_age_s: float, clock: Callable[[], float] = time.monotonic,
                 draining: Callable[[], bool] = lambda: False):
        self.app, self.max_age_s, self.clock, self.draining = app, max_age_s, clock, draining
        self._born: dict[tuple, float] = {}
        self._order: collections.deque[tuple[float, tuple]] = collections.deque()  # by birth: O(1) forgetting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        peer = scope.get("client")
        if not peer or self.max_age_s <= 0:
            return await self.app(scope, receive, _closing(send, self.draining))
        now, peer = self.clock(), tuple(peer)
        while self._order and self._order[0][0] < now - 2 * self.max_age_s:  # connections long gone
            born, old = self._order.popleft()
            if self._born.get(old) == born:
                del self._born[old]
        born = self._born.get(peer)
        if born is None:
            born = self._born[peer] = now
            self._order.append((now, peer))
        if born > now - self.max_age_s:
            return await self.app(scope, receive, _closing(send, self.draining))
        del self._born[peer]
        return await self.app(scope, receive, _closing(send, lambda: True))


def _closing(send, close: Callable[[], bool]):
    """`send` that adds `Connection: close` to the response's headers when `close()` says so as
    the response starts (uvicorn then closes): a request in flight at SIGTERM closes too."""
    async def closing(message):
        if message["type"] == "http.response.start" and close():
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing


class _EmbeddedServer(uvicorn.Server):
    """uvicorn as a task of our loop: the process's signals are ours, not uvicorn's."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """uvicorn serving `asgi` on host:port (TLS with `ssl_context`)."""

    def __init__(self, asgi, host: str, port: int, reuse_port: bool = False, ssl_context: ssl.SSLContext | None = None):
        self._socket = addresses.listening_socket(host)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # front ends share the port; the kernel spreads the connections
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._socket.bind((host, port))  # bound now, so port 0 resolves before start
        self.port = self._socket.getsockname()[1]
        # Our own context (tls.py: reloaded certificates reach new handshakes through it).
        factory = None if ssl_context is None else lambda config, default: ssl_context
        # log_config=None: uvicorn's lines go through the process's own handler (embedserve.logs:
        # LOG_FORMAT), not a handler and format of its own.
        # http: h11, parsed a slice a turn (http_protocol.py: why), whatever else is installed.
        config = uvicorn.Config(asgi, log_level="warning", access_log=False, lifespan="off", ssl_context_factory=factory,
                                log_config=None, http=SlicedH11Protocol)
        self._uvicorn = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[self._socket]))
        while not self._uvicorn.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()

    async def stop(self, timeout: float) -> None:
        """Stop; a request still unanswered `timeout` seconds on is cancelled. uvicorn's default
        waits for every connection to finish its request, forever: a client that sends its body
        slowly, or never, held the process past any grace."""
        if self._task:
            self._uvicorn.config.timeout_graceful_shutdown = max(0.1, timeout)
            self._uvicorn.should_exit = True
            await self._task
