"""The only module that registers kopf handlers: events in, reconcile calls out.

kopf watches the EmbeddingServices; what the services own is watched by our own informers
(cache.py), with a server-side label selector, so the operator never lists or streams the
cluster's other Deployments and Pods (kopf's `labels=` filter is applied client-side, after the
whole kind has been streamed). No handler here needs a finalizer (no timers, daemons or deletion
handlers: see fleet.py), so a service is never blocked from deletion by the operator, running or
not. Only the pod holding the lease (leader.py) acts; the others keep their copies warm."""

from __future__ import annotations

import asyncio
import copy
import logging

import kopf

from embedop import autoscaler, cache, crd, reconcile
from embedop.config import OperatorSettings
from embedop.fleet import Fleet
from embedop.kube import Kube, Retryable
from embedop.leader import Leadership

SETTINGS = OperatorSettings.from_env()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
log = logging.getLogger(__name__)
_fleet: Fleet | None = None
_tasks: list[asyncio.Task] = []
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
    if outcome.foreign:
        _say(body, "NotOwned", f"{', '.join(outcome.foreign)} belong(s) to someone else: not taken over", warning=True)
    if outcome.rejected:
        _say(body, "RejectedByAPI", outcome.rejected, warning=True)
    if outcome.notice:
        _say(body, "DefaultImageChanged", outcome.notice)
    if outcome.applied:
        log.info("%s/%s: applied %s", body["metadata"]["namespace"], body["metadata"]["name"], ", ".join(outcome.applied))


def _decision(body: dict, step: autoscaler.Step) -> None:
    decision, current = step.decision, step.current
    log.debug("autoscale %s: %d → %d (%s); demand %.0f, forecast %.0f, capacity %s tok/s", body["metadata"]["name"],
              current, decision.desired, decision.reason, decision.demand, decision.forecast, decision.capacity)
    if decision.desired != current:
        kopf.info(body, reason="Scaled", message=f"{current} → {decision.desired}: {decision.reason}")
    if step.refused:
        _say(body, "RejectedByAPI", f"the Deployment was refused ({step.refused}); its count changed through the "
                                    "scale subresource", warning=True)
    for reason, problem in (("ScalingLimited", "demand needs more than maxReplicas" if decision.limited else None),
                            ("MetricsUnavailable", step.unscraped)):
        if problem:
            _say(body, reason, problem, warning=True)
        else:  # said again when it comes back
            _said.pop((body["metadata"]["namespace"], body["metadata"]["name"], reason), None)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    global _fleet
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # No CRD/namespace scanning: the resources are known, and RBAC stays minimal.
    settings.scanning.disabled = True
    kube = Kube.connect(SETTINGS.api_timeout_s)
    stores = {kind: cache.Store() for kind in (*cache.WATCHED, crd.KIND)}
    leadership = None
    if SETTINGS.leader_election:
        leadership = Leadership(kube, SETTINGS.lease_namespace, SETTINGS.lease_name, SETTINGS.identity,
                                SETTINGS.lease_seconds, on_start=lambda: fleet().lead(), on_stop=lambda: fleet().close())
    cluster = cache.Cluster(kube, stores, leadership.held if leadership else lambda: True)
    _fleet = Fleet(cluster, SETTINGS, _outcome, _decision)
    namespaces = memo.get("namespaces") or None
    informers = [cache.Informer(kube, kind, namespaces, stores[kind], _fleet.kick) for kind in cache.WATCHED]
    _tasks.extend(asyncio.create_task(i.run(), name=f"informer:{i.kind}") for i in informers)
    # Handlers run once every owned kind has been listed: a reconcile never reads an empty copy.
    await asyncio.gather(*(i.synced.wait() for i in informers))
    if leadership:
        _tasks.append(asyncio.create_task(leadership.run(), name="leader-election"))


@kopf.on.cleanup()
async def shutdown(**_) -> None:
    for task in reversed(_tasks):  # the lease is released before the copies go
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if _fleet is not None:
        await _fleet.close()
        await _fleet.cluster.kube.close()


async def _reconcile(namespace: str, name: str) -> reconcile.Outcome | None:
    try:
        return await fleet().reconcile(namespace, name)
    except cache.NotLeader:
        return None
    except Retryable as e:
        raise kopf.TemporaryError(str(e), delay=e.retry_after or 5) from e


def _remember(body) -> None:
    """The service as kopf saw it, kept with the other copies (cache.py)."""
    fleet().cluster.stores[crd.KIND].put(copy.deepcopy(dict(body)))


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
async def service_changed(namespace, name, body, **_) -> None:
    _remember(body)
    outcome = await _reconcile(namespace, name)
    if outcome is not None and not outcome.gone:
        fleet().ensure(namespace, name)


@kopf.on.event(*RESOURCE)
async def service_event(event, body, **_) -> None:
    """Every service's latest state, for the copies; a deleted service's loop ends (kopf runs no
    other handler for deletions), and the finalizer of an older operator is taken off a service
    being deleted (the reconcile does that)."""
    meta = body.get("metadata", {})
    if event.get("type") == "DELETED":
        fleet().cluster.stores[crd.KIND].drop(meta["namespace"], meta["name"])
    else:
        _remember(body)
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        fleet().stop(meta["namespace"], meta["name"])
    if event.get("type") != "DELETED" and reconcile.LEGACY_FINALIZER in (meta.get("finalizers") or []):
        await _reconcile(meta["namespace"], meta["name"])
