"""The only module that registers kopf handlers: events in, reconcile calls out.

kopf watches the EmbeddingServices and hands every event of one to `service_event`, which keeps the
service's latest state with the other copies and has its loop reconcile it (fleet.py); what the
services own is watched by our own informers (cache.py), with a server-side label selector, so the
operator never lists or streams the cluster's other Deployments and Pods (kopf's `labels=` filter is
applied client-side, after the whole kind has been streamed).

Only event-watching handlers: kopf persists nothing for them (no annotations recording what was
handled, no finalizers, no "Handler succeeded" Events), so the operator writes nothing to a service
but its status and spec.replicas, and only the pod holding the lease (leader.py) writes at all; the
others keep their copies warm. The reconcile is level-based: it needs no diff of what changed. A
service is never blocked from deletion by the operator, running or not."""

from __future__ import annotations

import asyncio
import copy
import logging

import kopf

from embedop import autoscaler, cache, crd, reconcile, render_gateway, render_network, scaler, scope, status, write
from embedop.config import OperatorSettings
from embedop.fleet import Fleet
from embedop.kube import Kube
from embedop.leader import Leadership

SETTINGS = OperatorSettings.from_env()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
# The longest start-up waits for the owned kinds' first lists: within the chart's liveness probe
# (first at 10 s, killed after 3 failures 20 s apart: ~50 s), which kopf answers only after it.
SYNC_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)
_fleet: Fleet | None = None
_scaler: scaler.ScalerTerm | None = None  # KEDA's external scaler (mode keda), served while this pod leads
_tasks: list[asyncio.Task] = []
# What was last said in an Event per service, so a periodic check does not repeat it.
_said: dict[tuple[str, str, str], str] = {}
# Set when another release's older claim overlaps this operator's scope, found as one of its pods
# became the leader (scope.Term): kopf stops (__main__ passes it as the stop flag), and the process
# exits as a refusal at start-up does, with the message in `refusal`.
STOP = asyncio.Event()
refusal: str | None = None


def _refuse(message: str) -> None:
    global refusal
    refusal = message
    log.error("%s", message)
    STOP.set()


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
    if outcome.missing:
        _say(body, outcome.missing_reason or render_gateway.CRD_MISSING, outcome.missing, warning=True)
    if outcome.unpersisted:
        _say(body, write.FIELD_NOT_PERSISTED, "; ".join(outcome.unpersisted), warning=True)
    if outcome.misfit:
        _say(body, status.MISFIT, outcome.misfit, warning=True)
    if outcome.notice:
        _say(body, "DefaultImageChanged", outcome.notice)
    if outcome.warnings:
        _say(body, "SpecWarning", "; ".join(outcome.warnings), warning=True)
    else:  # said again when it comes back
        _said.pop((body["metadata"]["namespace"], body["metadata"]["name"], "SpecWarning"), None)
    if outcome.applied:
        log.info("%s/%s: applied %s", body["metadata"]["namespace"], body["metadata"]["name"], ", ".join(outcome.applied))


def _decision(body: dict, step: autoscaler.Step) -> None:
    decision, current = step.decision, step.current
    log.debug("autoscale %s: %d → %d (%s); demand %.0f, forecast %.0f, capacity %s tok/s; %.2f busy s/s",
              body["metadata"]["name"], current, decision.desired, decision.reason, decision.demand, decision.forecast,
              decision.capacity, decision.load)
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
    global _fleet, _scaler
    settings.posting.level = logging.INFO  # our own Events (kopf.info); kopf posts none of its logs
    settings.watching.server_timeout = 300
    # No CRD/namespace scanning: the resources are known, and RBAC stays minimal.
    settings.scanning.disabled = True
    if render_network.OperatorPods.of(SETTINGS).peer() is None:
        log.info("this operator's pods are unknown (EMBEDOP_POD_LABELS, POD_NAMESPACE): a service's NetworkPolicy "
                 "(spec.networkPolicy) opens its metrics port to spec.networkPolicy.metricsFrom only, not to it")
    kube = Kube.connect(SETTINGS.api_timeout_s)
    stores = {kind: cache.Store() for kind in (*cache.WATCHED, *cache.UNLABELLED, crd.KIND)}
    leadership = None
    may_write = lambda: True  # noqa: E731 - one operator pod, no election: checked at start-up only
    if SETTINGS.leader_election:
        # Each term starts with the scope checked again (claims change while pods run); nothing is
        # written until it has passed.
        term = scope.Term(kube, scope.own_claim(SETTINGS.pod_namespace, SETTINGS.scope_claim),
                          memo.get("namespaces") or [], _refuse)

        async def lead() -> None:
            if await term.start():
                # The scaler first: a ScaledObject the loops make must find its scaler answering
                # (KEDA builds its HPA from the triggers that answer, and would leave ours out).
                # One that cannot start (its port taken) must not keep every service unreconciled:
                # it is said, tried again at the next term or lapse, and the loops start anyway.
                try:
                    await _scaler.start()
                except Exception:  # noqa: BLE001 - grpc's bind failure is a bare RuntimeError
                    log.exception("the KEDA external scaler could not start on :%d: mode keda services are not "
                                  "scaled by this operator until it does", SETTINGS.scaler_port)
                await fleet().lead()

        async def end() -> None:
            term.end()
            try:
                await _scaler.stop()  # KEDA's connection closes: it reconnects to the next leader
            finally:
                await fleet().close()

        leadership = Leadership(kube, SETTINGS.lease_namespace, SETTINGS.lease_name, SETTINGS.identity,
                                SETTINGS.lease_seconds, on_start=lead, on_stop=end, request_s=SETTINGS.api_timeout_s)
        may_write = lambda: leadership.held() and term.passed  # noqa: E731
    cluster = cache.Cluster(kube, stores, may_write)
    _fleet = Fleet(cluster, SETTINGS, _outcome, _decision, leading=leadership is None)
    _scaler = scaler.ScalerTerm(_fleet.decisions, SETTINGS.scaler_port, kube, SETTINGS.pod_namespace, SETTINGS.pod_name,
                                leading=may_write, release=dict(SETTINGS.pod_labels or ()))
    await _scaler.forget()  # a label a crashed container of this pod left: not the leader yet
    namespaces = memo.get("namespaces") or None
    informers = [cache.Informer(kube, kind, namespaces, stores[kind], _fleet.kick,
                                labels={} if kind in cache.WATCHED_WHOLE else None) for kind in cache.WATCHED]
    # Not ours, so not labelled: every claim of the namespaces, read at each service's periodic
    # check; listed from the first read of one on (no claim in use: never).
    cluster.on_demand.update({kind: cache.Informer(kube, kind, namespaces, stores[kind], lambda *_: None, labels={})
                              for kind in cache.UNLABELLED})
    _tasks.extend(asyncio.create_task(i.run(), name=f"informer:{i.kind}") for i in informers)
    # Handlers run once every owned kind has been listed, so a reconcile never reads an empty copy;
    # but not never: kopf serves its liveness endpoint only after this, and a kind that cannot be
    # listed (RBAC, an API the cluster lacks) would be a silent crash loop. Past the wait, a missing
    # copy is read from the API (cache.Cluster.get), and the informers keep trying.
    try:
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in informers)), SYNC_TIMEOUT_S)
    except TimeoutError:
        log.error("not listed after %.0f s (see the warnings above): %s; going on, reading from the API instead",
                  SYNC_TIMEOUT_S, ", ".join(i.kind for i in informers if not i.synced.is_set()))
    if leadership:
        _tasks.append(asyncio.create_task(leadership.run(), name="leader-election"))
    else:  # one operator pod: it serves KEDA from the start
        await _scaler.start()


@kopf.on.cleanup()
async def shutdown(**_) -> None:
    if _scaler is not None:
        await _scaler.stop()
    if _fleet is not None:  # the loops end before the lease goes: no write after a successor's
        await _fleet.close()
    for task in [*reversed(_tasks), *(_fleet.cluster.tasks if _fleet else [])]:  # the lease goes, then the copies
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if _fleet is not None:
        await _fleet.cluster.kube.close()


def _remember(body) -> dict:
    """The service as kopf saw it, kept with the other copies (cache.py)."""
    obj = copy.deepcopy(dict(body))
    fleet().cluster.stores[crd.KIND].put(obj)
    return obj


@kopf.on.event(*RESOURCE)
async def service_event(event, body, **_) -> None:
    """Every event of every service (kopf's first listing included): its copy is kept, and its loop
    (started here, on the leader) reconciles it when its spec or metadata changed. A deleted
    service's loop ends, and so does that of a service being deleted (the garbage collector deletes
    what it owned; the operator never writes to the service object itself, only to its status and
    scale subresources)."""
    meta = body.get("metadata", {})
    namespace, name = meta["namespace"], meta["name"]
    if event.get("type") == "DELETED":
        fleet().cluster.stores[crd.KIND].drop(namespace, name)
        fleet().stop(namespace, name)
        return
    _remember(body)
    if not meta.get("deletionTimestamp"):
        fleet().changed(namespace, name, (meta.get("uid"), meta.get("generation")))
    else:
        fleet().stop(namespace, name)
