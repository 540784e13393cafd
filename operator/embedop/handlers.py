"""The only module that registers kopf handlers: events in, reconcile calls out."""

from __future__ import annotations

import collections
import logging
import threading
import time

import kopf

from embedop import autoscale, autoscaler, crd, reconcile, spec as specs
from embedop.config import OperatorSettings
from embedop.kube import Kube, Retryable, connect
from embedop.render import MANAGED_BY

SETTINGS = OperatorSettings.from_env()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        connect()
        _kube = Kube(timeout_s=SETTINGS.api_timeout_s)
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.finalizer = f"{crd.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # No CRD/namespace scanning: the resources are known, and RBAC stays minimal.
    settings.scanning.disabled = True
    # Timers run in threads and cannot be interrupted: check often whether they have ended,
    # so deletion (finalizer release) does not wait kopf's default minute.
    settings.background.cancellation_polling = 1
    kube()


# Sync handlers run on kopf's thread pool: one reconcile of a service at a time.
_locks: collections.defaultdict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)


def _reconcile(body, logger) -> None:
    meta = body["metadata"]
    try:
        with _locks[meta["namespace"], meta["name"]]:
            outcome = reconcile.reconcile(kube(), SETTINGS, dict(body))
    except Retryable as e:
        raise kopf.TemporaryError(str(e), delay=5) from e
    if outcome.problems:
        kopf.warn(dict(body), reason="InvalidSpec", message="; ".join(outcome.problems))
    elif outcome.applied:
        logger.info("applied %s", ", ".join(outcome.applied))


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
def service_changed(body, logger, **_) -> None:
    _reconcile(body, logger)


@kopf.timer(*RESOURCE, interval=SETTINGS.resync_seconds, initial_delay=SETTINGS.resync_seconds)
def resync(body, logger, **_) -> None:
    """Periodic check: reverts drift nobody told us about and refreshes status."""
    _reconcile(body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
def deployment_event(body, event, logger, **_) -> None:
    """A Deployment we own changed (rollout progress, or a hand edit): follow it."""
    if event.get("type") == "DELETED" or body.get("metadata", {}).get("labels", {}).get(
            "app.kubernetes.io/managed-by") != MANAGED_BY["app.kubernetes.io/managed-by"]:
        return  # label filters are not applied by every API server (nor by emulators)
    for ref in body.get("metadata", {}).get("ownerReferences", []):
        if ref.get("kind") == crd.KIND and ref.get("apiVersion") == crd.API_VERSION:
            owner = kube().get(crd.KIND, body["metadata"]["namespace"], ref["name"])
            if owner is not None and not owner["metadata"].get("deletionTimestamp"):
                _reconcile(owner, logger)


@kopf.daemon(*RESOURCE, cancellation_timeout=10)
async def autoscale_daemon(body, stopped, logger, **_) -> None:
    """mode: operator — every intervalSeconds, scale on the servers' own signal. The history
    (recommendations, demand trend, measured start-up time) lives here, per service."""
    history = autoscale.History()
    was_limited = False
    while not stopped:
        snapshot = dict(body)
        interval = specs.defaulted(snapshot.get("spec") or {})["autoscaling"]["intervalSeconds"]
        try:
            history, decision, current = await autoscaler.step(kube(), SETTINGS, snapshot, history, time.monotonic())
        except Retryable as e:
            logger.warning("autoscaling step skipped: %s", e)
        else:
            if decision is not None:
                logger.debug("autoscale: %d → %d (%s); demand %.0f, forecast %.0f, capacity %s tok/s",
                             current, decision.desired, decision.reason, decision.demand, decision.forecast, decision.capacity)
            if decision is not None and decision.desired != current:
                kopf.info(snapshot, reason="Scaled", message=f"{current} → {decision.desired}: {decision.reason}")
            limited = decision is not None and decision.limited
            if limited and not was_limited:
                kopf.warn(snapshot, reason="ScalingLimited", message=f"demand needs {decision.recommendation}+ replicas, more than maxReplicas")
            was_limited = limited
        await stopped.wait(interval)
