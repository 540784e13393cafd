"""The metrics port (METRICS_PORT, 8002): plain-text HTTP serving GET /health and GET /metrics,
and nothing else (any other method or path is 404: no API call gets past a key or TLS through it).

Why a port of its own, and why plain. What reads these two is infrastructure: kubelet's probes,
which can send neither a key nor a client certificate (its gRPC probe cannot do TLS at all), and
Prometheus and the operator's autoscaler, which scrape every pod by its IP, where a certificate
issued for the Service's name does not verify and a key would have to be handed to every
scraper. What they read grants no use of the model and holds no request's content: readiness,
the shared signal's gauges and the counters. So it is served without either, on a port a
NetworkPolicy can open to kubelet's node, Prometheus and the operator alone, while the API
ports are guarded. Bound in both modes: with FRONTENDS > 1 every front end binds it
(SO_REUSEPORT), as it does the API ports, and each answers for the pod (the model process's
state; counters summed over the processes). /health and /metrics also stay on the API port,
behind the key and TLS, for callers and gateways that check the port they use."""

from __future__ import annotations

from starlette.responses import PlainTextResponse

from embedserve.transports.budget import discard_body, discardable
from embedserve.transports.http_server import health_response, metrics_response
from embedserve.transports.hub import Hub

ANSWERS = {"/health": health_response, "/metrics": metrics_response}


def build_app(server: Hub):
    """An ASGI app: GET (and HEAD, GET without the body) of exactly /health or /metrics, answered as
    the API port answers them; 404 for any other method or path. No router: a router would
    answer another method 405 and /health/ with a redirect, more than this port has to say."""

    async def app(scope, receive, send):
        if scope["type"] != "http":  # a WebSocket upgrade: refused (uvicorn answers 403)
            return await send({"type": "websocket.close", "code": 1008})
        if discardable(scope):  # nothing here reads one: dropped, so the answer is not lost to a reset
            await discard_body(receive)
        answer = ANSWERS.get(scope["path"]) if scope["method"] in ("GET", "HEAD") else None
        response = await answer(server) if answer else PlainTextResponse("Not Found", status_code=404)
        await response(scope, receive, send)

    return app
