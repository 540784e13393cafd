"""The operator's configuration: one typed object, read from the environment once at start-up."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import uuid
from typing import Mapping

from embedop import __version__
from embedop.render import GRPC_PORT, HTTP_PORT


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    server_image: str = f"ghcr.io/embedfleet/embedserve:{__version__}"
    """EMBEDOP_SERVER_IMAGE: the server image used when a spec names none."""
    resync_seconds: float = 30.0
    """EMBEDOP_RESYNC_SECONDS: how often each service's owned objects and status are checked
    against the watches' copies (costs no API request when nothing drifted; drift is also reverted
    at once on the watch events)."""
    retry_seconds: float = 5.0
    """EMBEDOP_RETRY_SECONDS: how long a service's loop waits after a pass failed (an API error, an
    outage, a 404), doubled at each further failure in a row up to resync_seconds, with up to 20%
    less at random (services failing together do not retry together); nothing is sent for that
    service meanwhile, watch events included. A persistent failure so costs what a settled
    service's periodic check would, not a request every few seconds."""
    scrape_timeout_s: float = 2.0
    """EMBEDOP_SCRAPE_TIMEOUT_S: per-pod timeout of a /metrics scrape."""
    api_timeout_s: float = 5.0
    """EMBEDOP_API_TIMEOUT_S: the longest each Kubernetes API call the operator makes itself may
    take, all of it (connecting, sending, waiting, reading; watches and lists aside). Default 5,
    or a third of EMBEDOP_LEASE_SECONDS if less. With leader election it must stay under 0.4 × the
    lease (a start-up error otherwise): the leader stops starting writes this long, and at least a
    third of the lease, before a successor may take over, and renews every fifth of the lease with
    a call that may take this long, which must land before it stops (leader.py)."""
    metrics_port: int = 8002
    """EMBEDOP_METRICS_PORT: the servers' plain-text port of /health and /metrics only (never API
    keys or TLS): rendered into their METRICS_PORT, the container port `metrics`, the Services' port
    `metrics` and the NetworkPolicy. Where a service's health is read (probes, prometheus.io/port,
    the Services' `metrics` target, the autoscaler's scrape): here when keys, TLS or a NetworkPolicy
    guard its API port, else on the API port, 8001 (render.health_port). Not 50051 or 8001, the
    servers' gRPC and API ports."""
    grace_seconds: int = 45
    """EMBEDOP_GRACE_SECONDS: terminationGracePeriodSeconds of server pods (drain time)."""
    leader_election: bool = True
    """EMBEDOP_LEADER_ELECTION: hold a coordination.k8s.io Lease before writing anything, so that
    of several operator pods exactly one acts (false: one operator pod only, never two)."""
    lease_namespace: str = "default"
    """EMBEDOP_LEASE_NAMESPACE (else POD_NAMESPACE, the chart's downward API): where the Lease is."""
    lease_name: str = "embedop-leader"
    """EMBEDOP_LEASE_NAME: the Lease's name (operators sharing it elect one leader among them)."""
    lease_seconds: int = 15
    """EMBEDOP_LEASE_SECONDS: the Lease's duration in whole seconds (at least 3): how long a
    successor waits after the leader stops renewing (a crash; a clean stop releases it at once).
    Renewed every fifth of it; the leader stops writing a third of it, or EMBEDOP_API_TIMEOUT_S if
    longer, before a successor may take over (counted from when it sent its last renewal)."""
    pod_namespace: str = ""
    """EMBEDOP_POD_NAMESPACE (else POD_NAMESPACE, the chart's downward API): the operator pods'
    namespace, which a service's NetworkPolicy admits to the metrics port (with pod_labels)."""
    pod_labels: tuple[tuple[str, str], ...] = ()
    """EMBEDOP_POD_LABELS: `k=v,k=v`, labels every operator pod carries (the chart gives its selector
    labels): a service's NetworkPolicy admits pods with them, in pod_namespace, to the metrics port.
    Unset (an operator outside the cluster): the policy opens that port to spec.networkPolicy.metricsFrom only."""
    scope_claim: str = ""
    """EMBEDOP_SCOPE_CLAIM: the name of this operator's claim on the namespaces it watches, a Lease
    in pod_namespace that the chart makes (scope.py). At start-up, and at the start of each
    leadership term, the operator refuses to run where another release's older claim overlaps what
    it watches. Unset (outside the chart): it yields to
    every overlapping claim."""
    identity: str = ""
    """EMBEDOP_IDENTITY (else POD_NAME, else the host name) plus a random suffix: who holds the Lease."""
    pod_name: str = ""
    """EMBEDOP_POD_NAME (else POD_NAME, the chart's downward API): this operator pod's name. The
    leader labels its own pod (scaler.LEADER_LABEL), so that the scaler's Service reaches it alone."""
    scaler_port: int = 9090
    """EMBEDOP_SCALER_PORT: where the operator serves KEDA's external scaler (gRPC, externalscaler.proto;
    0: not served). Apart from the liveness port (8080): KEDA's operator alone calls it (mode keda)."""
    scaler_address: str = ""
    """EMBEDOP_SCALER_ADDRESS: host:port KEDA reaches that scaler at, as a mode keda ScaledObject's
    trigger names it (the chart's scaler Service, which selects the leader). Unset: embedop-scaler in
    pod_namespace, on scaler_port."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        env = os.environ if env is None else env
        d = cls()

        def positive(key: str, default: float) -> float:
            raw = env.get(key)
            value = float(raw) if raw else default
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key}={raw!r}: must be a positive number of seconds")
            return value

        election = (env.get("EMBEDOP_LEADER_ELECTION") or "true").strip().lower()
        if election not in ("true", "false", "1", "0"):
            raise ValueError(f"EMBEDOP_LEADER_ELECTION={election!r}: must be true or false")
        who = env.get("EMBEDOP_IDENTITY") or env.get("POD_NAME") or socket.gethostname()
        lease = lease_seconds(env.get("EMBEDOP_LEASE_SECONDS"), d.lease_seconds)
        api_timeout = positive("EMBEDOP_API_TIMEOUT_S", min(d.api_timeout_s, lease / 3))
        if election in ("true", "1"):
            check_lease(lease, api_timeout)
        return cls(
            server_image=env.get("EMBEDOP_SERVER_IMAGE") or d.server_image,
            resync_seconds=positive("EMBEDOP_RESYNC_SECONDS", d.resync_seconds),
            retry_seconds=positive("EMBEDOP_RETRY_SECONDS", d.retry_seconds),
            scrape_timeout_s=positive("EMBEDOP_SCRAPE_TIMEOUT_S", d.scrape_timeout_s),
            api_timeout_s=api_timeout,
            metrics_port=metrics_port(env.get("EMBEDOP_METRICS_PORT"), d.metrics_port),
            grace_seconds=int(env.get("EMBEDOP_GRACE_SECONDS") or d.grace_seconds),
            leader_election=election in ("true", "1"),
            lease_namespace=env.get("EMBEDOP_LEASE_NAMESPACE") or env.get("POD_NAMESPACE") or d.lease_namespace,
            lease_name=env.get("EMBEDOP_LEASE_NAME") or d.lease_name,
            lease_seconds=lease,
            pod_namespace=env.get("EMBEDOP_POD_NAMESPACE") or env.get("POD_NAMESPACE") or d.pod_namespace,
            pod_labels=label_pairs("EMBEDOP_POD_LABELS", env.get("EMBEDOP_POD_LABELS")),
            scope_claim=env.get("EMBEDOP_SCOPE_CLAIM") or d.scope_claim,
            pod_name=env.get("EMBEDOP_POD_NAME") or env.get("POD_NAME") or d.pod_name,
            scaler_port=scaler_port(env.get("EMBEDOP_SCALER_PORT"), d.scaler_port),
            scaler_address=env.get("EMBEDOP_SCALER_ADDRESS") or
            f"embedop-scaler.{env.get('EMBEDOP_POD_NAMESPACE') or env.get('POD_NAMESPACE') or 'default'}.svc:"
            f"{scaler_port(env.get('EMBEDOP_SCALER_PORT'), d.scaler_port)}",
            # A suffix: a pod restarted under the same name is a new candidate, not the old holder.
            identity=f"{who}_{uuid.uuid4().hex[:8]}",
        )


def scaler_port(raw: str | None, default: int) -> int:
    """EMBEDOP_SCALER_PORT: a TCP port, or 0 (not served)."""
    if raw is None or not raw.strip():
        return default
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"EMBEDOP_SCALER_PORT={raw!r}: must be a port number (0: not served)") from None
    if not 0 <= port <= 65535 or port == 8080:
        raise ValueError(f"EMBEDOP_SCALER_PORT={port}: must be 0 to 65535, and not 8080 (the liveness port)")
    return port


# The servers' own ports, which the metrics port may not be.
SERVER_PORTS = {"gRPC": GRPC_PORT, "HTTP API": HTTP_PORT}


def metrics_port(raw: str | None, default: int) -> int:
    """A TCP port, and not one the servers already bind for gRPC or the API: every server would exit
    at start-up ("the same port"), and every fleet with it."""
    if not raw:
        return default
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 65535:
        raise ValueError(f"EMBEDOP_METRICS_PORT={raw!r}: must be a TCP port, 1 to 65535")
    if taken := next((name for name, port in SERVER_PORTS.items() if port == int(raw)), None):
        raise ValueError(f"EMBEDOP_METRICS_PORT={raw!r}: that is the servers' {taken} port; choose another "
                         "(the default is 8002)")
    return int(raw)


def lease_seconds(raw: str | None, default: int) -> int:
    """Whole seconds, at least 3: the Lease stores an integer, and a holder counting 2.5 s where
    candidates read 2 would still write after a successor took over."""
    if not raw:
        return default
    if not raw.strip().isdigit() or int(raw) < 3:
        raise ValueError(f"EMBEDOP_LEASE_SECONDS={raw!r}: must be a whole number of seconds, at least 3")
    return int(raw)


# The longest API call a lease leaves room for, as a fraction of it (leader.py): the holder renews
# every fifth of the lease, with a call of up to the API timeout, and stops writing
# max(lease / 3, timeout) before a successor may start; the renewal must land before that.
MAX_TIMEOUT_OF_LEASE = 0.4


def check_lease(lease_s: int, api_timeout_s: float) -> None:
    """A lease that leaves the leader no time to renew with calls this long is refused at start:
    the leader would count itself one only between renewals, and its successor would start before
    its last write could land."""
    if api_timeout_s >= lease_s * 2 / 5:  # MAX_TIMEOUT_OF_LEASE, in exact arithmetic for whole seconds
        raise ValueError(
            f"EMBEDOP_API_TIMEOUT_S={api_timeout_s:g} with EMBEDOP_LEASE_SECONDS={lease_s}: the API timeout must be "
            f"under {MAX_TIMEOUT_OF_LEASE:g} × the lease (here under {MAX_TIMEOUT_OF_LEASE * lease_s:g} s), or the "
            f"leader's renewals cannot land before it must stop writing; lengthen the lease (at least "
            f"{math.floor(api_timeout_s / MAX_TIMEOUT_OF_LEASE) + 1} s) or shorten the timeout")


# A label's key (an optional DNS-subdomain prefix and a name) and value, as the API server checks them.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def label_pairs(key: str, raw: str | None) -> tuple[tuple[str, str], ...]:
    """`k=v,k=v` → ((k, v), ...), refused at start-up when not labels (a policy rendered from a typo
    would select no pod, and the operator could not scrape a single server)."""
    pairs = []
    for item in filter(None, (part.strip() for part in (raw or "").split(","))):
        name, eq, value = item.partition("=")
        if not eq or not LABEL_KEY.match(name.strip()) or not LABEL_VALUE.match(value.strip()):
            raise ValueError(f"{key}={raw!r}: {item!r} is not a label (k=v, comma-separated)")
        pairs.append((name.strip(), value.strip()))
    return tuple(pairs)
