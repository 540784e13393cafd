"""The transports know only the Hub and its Service (transports/hub.py). Both kinds of process
have them: the one process's Server and its EmbeddingService, a front end and its RemoteService.
Checked member by member, so a Protocol that drifts from what is served fails here, not in a pod."""

from __future__ import annotations

import dataclasses
import inspect

from embedserve.app import Server
from embedserve.batching.shaping import InFlight
from embedserve.config import Settings
from embedserve.frontends.frontend import Frontend, RemoteService
from embedserve.service import EmbeddingService
from embedserve.transports.hub import Hub, Service


def members(protocol) -> set[str]:
    return {name for klass in protocol.__mro__ if klass.__module__ == protocol.__module__
            for name in (*getattr(klass, "__annotations__", {}), *(n for n, _ in inspect.getmembers(klass) if not n.startswith("_")))}


async def test_both_hubs_have_what_the_transports_use(tmp_path):
    settings = dataclasses.replace(Settings(), grpc_port=0, http_port=0, metrics_port=0, warm_start="false",
                                   model_cache_dir=str(tmp_path))
    hubs = [Server(settings, listen=False), Frontend(settings, str(tmp_path / "model.ipc"))]
    for hub in hubs:
        missing = sorted(m for m in members(Hub) if not hasattr(hub, m))
        assert missing == [], (type(hub).__name__, missing)


def test_both_services_have_what_the_transports_call():
    for service in (EmbeddingService, RemoteService):
        assert issubclass(service, InFlight)  # draining, in_flight, drained()
        declared = {n for k in service.__mro__ for n in getattr(k, "__annotations__", {})}  # set in __init__
        missing = sorted(m for m in members(Service) if not hasattr(service, m) and not hasattr(InFlight(), m)
                         and m not in declared)
        assert missing == [], (service.__name__, missing)
