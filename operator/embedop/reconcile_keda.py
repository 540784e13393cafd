"""Mode keda's objects in one reconcile (reconcile._apply_owned calls it): KEDA's ScaledObject and,
with minReplicas 0, the HTTP add-on's routes (render_keda), applied like the other owned objects
(created when absent, applied when ours, drift-checked, held when they do not stick: the
reconcile's `put`), and deleted, when ours, once the spec no longer asks for them (the service left
mode keda, stops scaling to zero, or the cluster's add-on now takes the other route kind).

What the cluster lacks is said, not retried blindly: a kind whose informer found its CRD absent
(cache.Store.absent) is not written at all, and a write answered 404 (the CRD went meanwhile, or
the informer has not listed yet) says the same. Without KEDA nothing of this mode is written and the
service is Degraded naming KEDA's CRD; the Deployment keeps the count it has (its replicas were
handed over as in mode hpa). Without the add-on, a service asking for zero keeps one pod (the
ScaledObject's floor) and is Degraded naming the add-on's CRDs: nothing could wake it. A KEDA HPA
built while the operator's scaler did not answer lacks its metric (render_keda.lacks_our_metric):
Degraded, and KEDA is asked to build it again.

The Deployment's spec.replicas is not handled here: render.deployment_replicas leaves it to KEDA's
HorizontalPodAutoscaler in mode keda, and the reconcile hands it over as for mode hpa."""

from __future__ import annotations

import datetime
from typing import Awaitable, Callable

from embedop import render, render_keda
from embedop.cache import Cluster
from embedop.config import OperatorSettings
from embedop.kube import NotFound

# The reconcile's write of one owned object (reconcile.put_owned): → the live object, None when it
# belongs to someone else (reported as NotOwned); NotFound when the API does not serve its kind.
Put = Callable[[dict], Awaitable[dict | None]]
# (reason, message): what the cluster lacks (a CRD, our metric in KEDA's HPA), for Degraded and an
# Event (reconcile.Outcome.lack).
Lack = Callable[[str, str], None]


async def apply(cluster: Cluster, settings: OperatorSettings, owner: render.Owner, spec: dict, put: Put,
                lack: Lack) -> tuple[list[str], dict | None]:
    """Apply what mode keda renders for the service now and delete what it no longer renders.
    → ("-Kind/name" of each object deleted, KEDA's HorizontalPodAutoscaler of the service, for
    status: its desiredReplicas)."""
    keda = spec["autoscaling"]["mode"] == "keda"
    written: set[tuple[str, str]] = set()
    if keda and not cluster.serves(render_keda.KIND):
        lack(render_keda.KEDA_MISSING, render_keda.missing_keda_message("its informer's list answered 404"))
    elif keda:
        written = await _put_all(cluster, settings, owner, spec, put, lack)
    deleted = []
    for kind, name in render_keda.owned_names(owner.name):
        if (kind, name) in written:
            continue
        existing = await cluster.get(kind, owner.namespace, name, ours=True)
        if existing is not None and owner.owns(existing):
            await cluster.delete(kind, owner.namespace, name)
            deleted.append(f"-{kind}/{name}")
    hpa = await cluster.get("HorizontalPodAutoscaler", owner.namespace, render_keda.hpa_name(owner.name),
                            ours=True) if keda else None
    if keda and (render_keda.KIND, owner.name) in written and render_keda.lacks_our_metric(hpa):
        await _rebuild(cluster, owner, hpa)
        lack(render_keda.METRIC_MISSING, render_keda.missing_metric_message(hpa["metadata"]["name"],
                                                                            settings.scaler_address))
    else:
        cluster.rebuilt.pop((owner.namespace, owner.name), None)
    return deleted, hpa


async def _rebuild(cluster: Cluster, owner: render.Owner, hpa: dict) -> None:
    """Ask KEDA to build its HPA again (render_keda.REBUILD_ANNOTATION), now that this operator's
    scaler answers (the reconcile runs on the leader, which serves it); again after growing waits
    while the metric stays missing (render_keda.REBUILD_AFTER_S)."""
    key, now = (owner.namespace, owner.name), cluster.clock()
    if not render_keda.rebuild_due(last := cluster.rebuilt.get(key), now):
        return
    cluster.rebuilt[key] = (now, (last or (now, 0))[1] + 1)
    await cluster.annotate("HorizontalPodAutoscaler", owner.namespace, hpa["metadata"]["name"],
                           {render_keda.REBUILD_ANNOTATION: datetime.datetime.now(datetime.timezone.utc).isoformat()})


async def _put_all(cluster: Cluster, settings: OperatorSettings, owner: render.Owner, spec: dict, put: Put,
                   lack: Lack) -> set[tuple[str, str]]:
    """The routes first, then the ScaledObject whose triggers name them (KEDA's add-on scaler
    would find no route for a trigger that came first). → (kind, name) of what is in place."""
    route = render_keda.route_kind(cluster.serves) if render_keda.scales_to_zero(spec) else None
    *routes, scaled = render.keda_objects(owner, spec, settings.scaler_address, route)
    written = set()
    for obj in routes:
        try:
            await put(obj)
        except NotFound:  # the add-on's CRD went (or was never there): the floor stays at one pod
            route = None
            break
        written.add((obj["kind"], obj["metadata"]["name"]))
    no_addon = render_keda.scales_to_zero(spec) and route is None
    if no_addon:
        written = set()  # routes written before a 404 are of a kind the ScaledObject no longer names
        (scaled,) = render.keda_objects(owner, spec, settings.scaler_address, None)
    try:
        await put(scaled)
    except NotFound as e:  # KEDA itself is missing: that is what to say (the add-on's lack follows from it)
        lack(render_keda.KEDA_MISSING, render_keda.missing_keda_message(str(e)))
        return written
    if no_addon:
        lack(render_keda.ADDON_MISSING, render_keda.missing_addon_message())
    return written | {(render_keda.KIND, owner.name)}
