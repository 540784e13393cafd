"""The only module that registers kopf handlers: events in, reconcile calls out.

No handler here needs a finalizer (no timers, daemons or deletion handlers: see fleet.py), so a
service is never blocked from deletion by the operator, running or not."""

from __future__ import annotations

import logging

import kopf

from embedop import autoscaler, crd, reconcile
from embedop.config import OperatorSettings
from embedop.fleet import Fleet
from embedop.kube import Kube, Retryable
from embedop.render import MANAGED_BY

SETTINGS = OperatorSettings.from_env()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
_fleet: Fleet | None = None
# What was last said in an Event per service, so a periodic check does not repeat it.
_said: dict[tuple[str, str, str], str] = {}


def fleet() -> Fleet:
    assert _fleet is not None, "the operator has not started"
    return _fleet


def _say(body: dict, reason: str, message: str, warning: bool = False) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"], reason)
    if _said.get(key) != message:
        _said[key] = message
        (kopf.warn if warning else kopf.info)(body, reason=reason, message=message)


def _outcome(outcome: reconcile.Outcome) -> None:
    body = outcome.body
    if body is None or outcome.gone:
        return
    if outcome.problems:
        _say(body, "InvalidSpec", "; ".join(outcome.problems), warning=True)
    if outcome.rejected:
        _say(body, "RejectedByAPI", outcome.rejected, warning=True)
    if outcome.notice:
        _say(body, "DefaultImageChanged", outcome.notice)
    if outcome.applied:
        logging.getLogger(__name__).info("%s/%s: applied %s", body["metadata"]["namespace"],
                                         body["metadata"]["name"], ", ".join(outcome.applied))


def _decision(body: dict, step: autoscaler.Step) -> None:
    decision, current = step.decision, step.current
    log = logging.getLogger(__name__)
    log.debug("autoscale %s: %d → %d (%s); demand %.0f, forecast %.0f, capacity %s tok/s", body["metadata"]["name"],
              current, decision.desired, decision.reason, decision.demand, decision.forecast, decision.capacity)
    if decision.desired != current:
        kopf.info(body, reason="Scaled", message=f"{current} → {decision.desired}: {decision.reason}")
    for reason, problem in (("ScalingLimited", "demand needs more than maxReplicas" if decision.limited else None),
                            ("MetricsUnavailable", step.unscraped)):
        if problem:
            _say(body, reason, problem, warning=True)
        else:  # said again when it comes back
            _said.pop((body["metadata"]["namespace"], body["metadata"]["name"], reason), None)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_) -> None:
    global _fleet
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # No CRD/namespace scanning: the resources are known, and RBAC stays minimal.
    settings.scanning.disabled = True
    _fleet = Fleet(Kube.connect(SETTINGS.api_timeout_s), SETTINGS, _outcome, _decision)


@kopf.on.cleanup()
async def shutdown(**_) -> None:
    if _fleet is not None:
        await _fleet.close()
        await _fleet.kube.close()


async def _reconcile(namespace: str, name: str) -> reconcile.Outcome:
    try:
        return await fleet().reconcile(namespace, name)
    except Retryable as e:
        raise kopf.TemporaryError(str(e), delay=5) from e


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
async def service_changed(namespace, name, **_) -> None:
    if not (await _reconcile(namespace, name)).gone:
        fleet().ensure(namespace, name)


@kopf.on.event(*RESOURCE)
async def service_event(event, body, **_) -> None:
    """A deleted service's loop ends (kopf runs no other handler for deletions), and the finalizer
    of an older operator is taken off a service being deleted (the reconcile does that)."""
    meta = body.get("metadata", {})
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        fleet().stop(meta["namespace"], meta["name"])
    if event.get("type") != "DELETED" and reconcile.LEGACY_FINALIZER in (meta.get("finalizers") or []):
        await _reconcile(meta["namespace"], meta["name"])


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
async def deployment_event(body, event, **_) -> None:
    """A Deployment we own changed (rollout progress, a hand edit, a deletion): follow it."""
    meta = body.get("metadata", {})
    if (meta.get("labels") or {}).get(
            "app.kubernetes.io/managed-by") != MANAGED_BY["app.kubernetes.io/managed-by"]:
        return  # label filters are not applied by every API server (nor by emulators)
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == crd.KIND and ref.get("apiVersion") == crd.API_VERSION:
            try:
                await fleet().reconcile(meta["namespace"], ref["name"])
            except Retryable as e:  # the service's loop tries again
                logging.getLogger(__name__).warning("following Deployment %s: %s", meta.get("name"), e)
            else:  # a marker in the log (the tests wait for it rather than for time to pass)
                logging.getLogger(__name__).debug("followed Deployment %s/%s (%s)", meta["namespace"],
                                                  meta.get("name"), event.get("type"))
