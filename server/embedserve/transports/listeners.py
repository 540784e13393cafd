"""The listeners of one serving process, gRPC (with grpc.health.v1 and reflection), the API's HTTP
and the plain metrics port, and their graceful stop: the same in a single-process server and in
each front end (FRONTENDS > 1, where every front end binds the same ports with SO_REUSEPORT and
the kernel spreads connections). The API key's check and TLS (auth.py, tls.py) are put in front
of the gRPC and API ports only when configured, with one task that reads their files again when
they change (reloads.py).

What they serve from is a Hub (hub.py): the one process's Server, or a front end's link to the
model process."""

from __future__ import annotations

import asyncio
import logging
import time

from embedserve.transports import addresses, auth, drain, grpc_budget, grpc_server, http_api, http_server, metrics_port, reloads, tls
from embedserve.lifecycle import watch_loop_lag
from embedserve.transports.hub import Hub

log = logging.getLogger(__name__)


class Transports:
    def __init__(self, hub: Hub, reuse_port: bool = False):
        s = hub.settings
        self.hub = hub
        host = addresses.bind_host(s.host)
        held_s = (s.reservation_horizon_ms + s.max_drain_time_ms) / 1000
        if s.max_connection_age_s > 0 and s.max_connection_age_grace_s < held_s:
            log.warning("MAX_CONNECTION_AGE_GRACE_S (%.1f) is below RESERVATION_HORIZON_MS + MAX_DRAIN_TIME_MS "
                        "(%.1f s): a call held for its booked room may be cut when its connection ages out",
                        s.max_connection_age_grace_s, held_s)
        self.keys = auth.from_settings(s, hub.metrics.auth_refused)  # None: no key, nothing checks one
        self.tls = tls.from_settings(s)  # None: plain ports
        keyed = self.keys is not None
        for reason in auth.MESSAGES if keyed else ():
            hub.metrics.auth_refused(reason, 0)
        servicer = grpc_server.InferenceServicer(hub.model, hub.health_fields, hub.metrics.request_finished,
                                                 hub.drain_s, s.max_reply_bytes)
        self.grpc, self.health, self.grpc_port = grpc_server.build_server(
            servicer, host, s.grpc_port, s.max_message_bytes, s.max_connection_age_s,
            s.max_connection_age_grace_s, reuse_port, interceptors=[auth.GrpcKeys(self.keys)] if keyed else None,
            credentials=self.tls.grpc_credentials() if self.tls else None, max_reply_bytes=s.max_reply_bytes,
            max_concurrent=s.max_concurrent_requests,
            max_fields=s.max_texts_per_request + grpc_budget.FIELDS_BESIDE_TEXTS)
        self.api = http_server.build_app(hub)  # the routes; install_api adds the model's
        paths = http_api.api_paths(hub)
        api = drain.DrainHeader(self.api, hub.drain_s, paths)
        api = auth.HttpKeys(api, self.keys, paths) if keyed else api
        self.http = http_server.HttpServer(
            http_server.ConnectionAge(api, s.max_connection_age_s, draining=lambda: hub.draining), host, s.http_port,
            reuse_port, self.tls.http_context if self.tls else None)
        self.metrics_http = http_server.HttpServer(metrics_port.build_app(hub), host, s.metrics_port, reuse_port)
        self._reloads = [c.reload for c in (self.keys, self.tls) if c is not None]
        self._reloading: asyncio.Task | None = None
        self._lag: asyncio.Task | None = None

    async def start(self) -> None:
        await grpc_server.set_serving(self.health, False)  # grpc's default is SERVING
        await self.grpc.start()
        await self.http.start()
        await self.metrics_http.start()
        if self._reloads:
            self._reloading = asyncio.create_task(reloads.every(reloads.RELOAD_EVERY_S, self._reloads), name="reloads")
        self._lag = asyncio.create_task(watch_loop_lag(self.hub.metrics.loop_lag.observe), name="loop-lag")
        log.info("metrics (plain HTTP: /health, /metrics) on :%d; gRPC and API HTTP: %s, %s", self.metrics_http.port,
                 "TLS" + (" with client certificates" if self.tls.client_auth else "") if self.tls else "plain text",
                 "API key required" if self.keys is not None else "no API key")

    async def serving(self, serving: bool) -> None:
        await grpc_server.set_serving(self.health, serving)

    def install_api(self) -> None:
        http_api.install_routes(self.api, self.hub)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING at once; the listeners stay open while in-flight requests finish: a request
        that arrives now (endpoints lag SIGTERM in Kubernetes) gets a retryable UNAVAILABLE from
        the service rather than a transport-level CANCELLED from a closing server."""
        await self.serving(False)
        deadline = time.monotonic() + grace
        services = [m.service for m in self.hub.models.values() if m.service]
        for service in services:
            service.draining = True
        try:
            if any(service.in_flight for service in services):
                await asyncio.wait_for(asyncio.gather(*(service.drained() for service in services)), grace)
        except asyncio.TimeoutError:
            log.warning("grace period over: %d requests still in flight are cancelled",
                        sum(service.in_flight for service in services))
        await self.grpc.stop(max(0.0, deadline - time.monotonic()))
        await self.http.stop(deadline - time.monotonic())
        # Last: probes and scrapes are answered (503, draining) for as long as anything is.
        await self.metrics_http.stop(deadline - time.monotonic())
        if self._reloading:
            self._reloading.cancel()
        if self._lag:
            self._lag.cancel()

