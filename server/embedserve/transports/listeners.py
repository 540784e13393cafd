"""The listeners of one serving process, gRPC (with grpc.health.v1 and reflection) and HTTP, and
their graceful stop: the same in a single-process server and in each front end (FRONTENDS > 1,
where every front end binds the same ports with SO_REUSEPORT and the kernel spreads connections).

What they serve from is a Hub (hub.py): the one process's Server, or a front end's link to the
model process."""

from __future__ import annotations

import asyncio
import logging
import time

from embedserve.transports import grpc_server
from embedserve.transports import http_server
from embedserve.transports.hub import Hub

log = logging.getLogger(__name__)


class Transports:
    def __init__(self, hub: Hub, reuse_port: bool = False):
        s = hub.settings
        self.hub = hub
        held_s = (s.reservation_horizon_ms + s.max_drain_time_ms) / 1000
        if s.max_connection_age_s > 0 and s.max_connection_age_grace_s < held_s:
            log.warning("MAX_CONNECTION_AGE_GRACE_S (%.1f) is below RESERVATION_HORIZON_MS + MAX_DRAIN_TIME_MS "
                        "(%.1f s): a call held for its booked room may be cut when its connection ages out",
                        s.max_connection_age_grace_s, held_s)
        servicer = grpc_server.InferenceServicer(lambda: hub.service, hub.health_fields, hub.metrics.request_finished,
                                                 s.quantize_range, lambda: hub.model_dimension)
        self.grpc, self.health, self.grpc_port = grpc_server.build_server(
            servicer, s.host, s.grpc_port, s.max_message_bytes, s.max_connection_age_s,
            s.max_connection_age_grace_s, reuse_port)
        self.http = http_server.HttpServer(hub, s.host, s.http_port, s.max_connection_age_s, reuse_port)

    async def start(self) -> None:
        await grpc_server.set_serving(self.health, False)  # grpc's default is SERVING
        await self.grpc.start()
        await self.http.start()

    async def serving(self, serving: bool) -> None:
        await grpc_server.set_serving(self.health, serving)

    def install_api(self) -> None:
        self.http.install_api(self.hub)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING at once; the listeners stay open while in-flight requests finish: a request
        that arrives now (endpoints lag SIGTERM in Kubernetes) gets a retryable UNAVAILABLE from
        the service rather than a transport-level CANCELLED from a closing server."""
        await self.serving(False)
        deadline = time.monotonic() + grace
        service = self.hub.service
        if service:
            service.draining = True
            try:
                await asyncio.wait_for(service.drained(), grace)
            except asyncio.TimeoutError:
                log.warning("grace period over: %d requests still in flight are cancelled", service.in_flight)
        await self.grpc.stop(max(0.0, deadline - time.monotonic()))
        await self.http.stop(deadline - time.monotonic())
