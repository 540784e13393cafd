"""The operator's configuration: one typed object, read from the environment once at start-up."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from embedop import __version__


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    server_image: str = f"ghcr.io/embedfleet/embedserve:{__version__}"
    """EMBEDOP_SERVER_IMAGE: the server image used when a spec names none."""
    resync_seconds: float = 30.0
    """EMBEDOP_RESYNC_SECONDS: how often each service's owned objects and status are checked
    (drift is also reverted at once on events)."""
    scrape_timeout_s: float = 2.0
    """EMBEDOP_SCRAPE_TIMEOUT_S: per-pod timeout of a /metrics scrape."""
    api_timeout_s: float = 10.0
    """EMBEDOP_API_TIMEOUT_S: timeout of each Kubernetes API call the operator makes itself."""
    metrics_port: int = 8001
    """EMBEDOP_METRICS_PORT: the servers' HTTP port (/health, /metrics): rendered into their
    HTTP_HEALTH_PORT, probes and Services, and scraped by the autoscaler."""
    grace_seconds: int = 45
    """EMBEDOP_GRACE_SECONDS: terminationGracePeriodSeconds of server pods (drain time)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        env = os.environ if env is None else env
        d = cls()
        return cls(
            server_image=env.get("EMBEDOP_SERVER_IMAGE") or d.server_image,
            resync_seconds=float(env.get("EMBEDOP_RESYNC_SECONDS") or d.resync_seconds),
            scrape_timeout_s=float(env.get("EMBEDOP_SCRAPE_TIMEOUT_S") or d.scrape_timeout_s),
            api_timeout_s=float(env.get("EMBEDOP_API_TIMEOUT_S") or d.api_timeout_s),
            metrics_port=int(env.get("EMBEDOP_METRICS_PORT") or d.metrics_port),
            grace_seconds=int(env.get("EMBEDOP_GRACE_SECONDS") or d.grace_seconds),
        )
