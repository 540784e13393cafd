"""HTTP transport on HTTP_HEALTH_PORT: GET /health, GET /metrics, and the JSON API of http_api
(uvicorn in our event loop; OpenAPI at /openapi.json)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from embedserve import http_api
from embedserve.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from embedserve.app import Server


def build_app(server: "Server") -> FastAPI:
    app = FastAPI(title="embedfleet server", version="0.1.0")

    @app.get("/health")
    async def health() -> JSONResponse:
        """The shared signal and readiness; 503 while starting, draining, or failing batches."""
        return JSONResponse(server.health_fields(), status_code=200 if server.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    http_api.register(app, server)
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn as a task of our loop: the process's signals are ours, not uvicorn's."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, server: "Server", host: str, port: int):
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # bound now, so port 0 resolves before start
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(build_app(server), log_level="warning", access_log=False, lifespan="off")
        self._uvicorn = _EmbeddedServer(config)
        self.app = config.app
        self._task: asyncio.Task | None = None

    def install_api(self, server: "Server") -> None:
        http_api.install_routes(self.app, server)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[self._socket]))
        while not self._uvicorn.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()

    async def stop(self) -> None:
        if self._task:
            self._uvicorn.should_exit = True
            await self._task
