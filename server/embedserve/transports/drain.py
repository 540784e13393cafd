"""`embedfleet-drain-ms` on every answer of the serving API: milliseconds of model time queued
ahead on this pod as the answer leaves (queued real tokens / service rate), so a client that
balances over pods (embedserve.client: least-drain routing) learns each pod's backlog from the
answers it gets anyway, refusals included (an overloaded pod's estimate is the most useful one).
gRPC sends it as trailing metadata (grpc_server.py), HTTP as a response header on the API routes
(`DrainHeader`, in front of the API port's app; the metrics port has none: what reads it is
infrastructure, not a balancing client). Behind an API key only callers with the key see it."""

from __future__ import annotations

from typing import Callable

HEADER = "embedfleet-drain-ms"
UNKNOWN_MS = 1e9  # the backlog with no service rate measured yet (drain_s infinite): "unknown"


def drain_ms(drain_s: float) -> str:
    """The header's value: one decimal of milliseconds, capped at UNKNOWN_MS."""
    return f"{min(drain_s * 1000, UNKNOWN_MS):.1f}"


class DrainHeader:
    """ASGI middleware: `embedfleet-drain-ms` on every response of a path in `paths` (errors
    included), read from `drain_s()` as the response starts."""

    def __init__(self, app, drain_s: Callable[[], float], paths: frozenset[str]):
        self.app, self.drain_s, self.paths = app, drain_s, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)

        async def stamped(message):
            if message["type"] == "http.response.start":
                header = (HEADER.encode(), drain_ms(self.drain_s()).encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return await self.app(scope, receive, stamped)
