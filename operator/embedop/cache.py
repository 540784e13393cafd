"""What the operator reads: in-memory copies of the objects it owns, kept current by list + watch
(client-go's informers), so that a settled service costs no API request at all.

The owned kinds (Deployments, their Pods, Services, PodDisruptionBudgets, HorizontalPodAutoscalers,
NetworkPolicies, InferencePools where the cluster has their CRD: OPTIONAL_WATCHED, the Jobs that
fill a pre-filled model cache) are listed and watched with a server-side label selector, the operator's managed-by label: the
API server sends only the fleets' objects, never every Deployment or Pod of the cluster. The
EmbeddingServices themselves come from kopf's own watch (handlers.py puts each event here). The
model caches' claims, which are not ours and carry no label of ours, are watched whole in the
served namespaces (UNLABELLED), trimmed to the few fields read, from the first read of one on
(Cluster.on_demand): an operator whose services mount no claim never lists them, and a list its
RBAC refuses (a chart from before the claims) does not hold up its start.

Reads come from these copies. An object missing from them is read from the API (`Cluster.get`):
it may exist without our label (someone else's object of the same name, which the reconcile must
not take over) or its watch event may not have arrived yet. Writes go to the API, guarded by the
resourceVersion they were computed from, and their answers are kept here at once (write-through),
so the next read does not act on the state before our own write. A write computed from a stale
copy fails with Conflict; the caller then reads fresh (`fresh=True`) and computes again.

Every write first checks `may_write` (the leader election's lease), so that of two operator pods
only the one holding the lease ever changes anything."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable

from embedop import crd, drift
from embedop import render_gateway, render_keda
from embedop.kube import Gone, Kube, NotFound, Retryable
from embedop.render import MANAGED_BY

log = logging.getLogger(__name__)

# The kinds listed and watched by the operator's label (the pods carry it through the template;
# KEDA copies a ScaledObject's labels onto the HorizontalPodAutoscaler it makes, so KEDA's HPA of a
# service in mode keda is among the HPAs listed, and kicks the service's reconcile when it moves).
WATCHED = ("Deployment", "Pod", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy",
           render_gateway.KIND, "Job", *render_keda.KINDS)
# Kinds of a CRD a cluster may not have installed (the Gateway API Inference Extension's, KEDA's
# and its HTTP add-on's): the API
# answers their list 404. Then none exists, which is what the empty copy says: the informer counts
# as listed (the handlers do not wait for it, and the reconcile's "is there one of ours to delete?"
# stays a read of the copy, no API call) and lists again every ABSENT_RECHECK_S, quietly, so a CRD
# installed later is picked up without a restart. Only a service that asks for one gets told.
OPTIONAL_WATCHED = (render_gateway.KIND, *render_keda.KINDS)
# Owned kinds watched whole, others' objects too (few per namespace): a ScaledObject someone made
# for a service (render_keda.fighting) is said at the service's next check.
WATCHED_WHOLE = (render_keda.KIND,)
# Kinds the operator reads but does not own, so they carry no label of ours: listed and watched
# whole in the namespaces it serves (the model cache's claims: their access modes and uid), kept
# trimmed to what is read (TRIM), followed at the services' periodic checks (no kick); their
# informer starts at the first read of one (Cluster.on_demand), which waits up to DEMAND_WAIT_S
# for its first list (else, and until it has listed, a claim is read by name).
UNLABELLED = ("PersistentVolumeClaim",)
DEMAND_WAIT_S = 5.0
ABSENT_RECHECK_S = 60.0
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; it is resumed where it stopped
BACKOFF_S = (0.5, 30.0)  # first and largest wait before listing again after a failure


def _trim_claim(obj: dict) -> dict:
    """What is read of a claim (every claim of the namespaces is kept: a few fields each)."""
    meta, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp")
                         if k in meta},
            "spec": {k: spec[k] for k in ("accessModes", "volumeName", "storageClassName") if k in spec},
            "status": {k: st[k] for k in ("phase", "accessModes") if k in st}}


def _trim_scaled_object(obj: dict) -> dict:
    """Ours whole (drift compares it); someone else's (WATCHED_WHOLE): what render_keda.fighting
    reads, not its triggers and KEDA's frequent status writes."""
    if _ours(obj):
        return obj
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences",
                                              "deletionTimestamp") if k in meta},
            "spec": {"scaleTargetRef": (obj.get("spec") or {}).get("scaleTargetRef") or {}}}


TRIM = {"PersistentVolumeClaim": _trim_claim, render_keda.KIND: _trim_scaled_object}

Key = tuple[str, str]


def key_of(obj: dict) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace") or "", meta["name"]


class NotLeader(Retryable):
    """This operator pod does not hold the lease: it must not write."""


class Store:
    """The objects of one kind, by (namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict] = {}
        # An OPTIONAL_WATCHED kind the API does not serve (its CRD is not installed), as its
        # informer last found it; None: not known (not listed yet, or not watched).
        self.absent: bool | None = None

    def get(self, namespace: str, name: str) -> dict | None:
        return self.objects.get((namespace, name))

    def put(self, obj: dict) -> None:
        """Keep `obj` unless the copy is newer: a watch event can arrive after the answer to our
        own later write. Versions are compared only where both are integers (etcd's revisions,
        which every API server in use gives; they are opaque by contract, so otherwise: replace)."""
        key = key_of(obj)
        old = self.objects.get(key)
        if old is not None and _older(obj, old):
            return
        self.objects[key] = obj

    def drop(self, namespace: str, name: str) -> None:
        self.objects.pop((namespace, name), None)

    def replace(self, namespace: str | None, objects: list[dict]) -> None:
        """What a fresh list says of `namespace` (None: all): what it lacks was deleted meanwhile."""
        self.objects = {k: v for k, v in self.objects.items() if namespace is not None and k[0] != namespace}
        for obj in objects:
            self.put(obj)

    def select(self, namespace: str, labels: dict) -> list[dict]:
        return [o for (ns, _), o in self.objects.items() if ns == namespace
                and all(((o["metadata"].get("labels") or {}).get(k)) == v for k, v in labels.items())]


class Informer:
    """One kind, listed then watched from the list's resourceVersion, in each namespace the
    operator serves (None: all). Listed again after a 410 Gone (the version is too old) or any
    failure (with backoff, and at the API's Retry-After). `on_change(kind, event, obj)` is called
    for every object that changed or went (event: ADDED, MODIFIED, DELETED; LISTED after a list)."""

    def __init__(self, kube: Kube, kind: str, namespaces: list[str] | None, store: Store,
                 on_change: Callable[[str, str, dict], None], labels: dict | None = None):
        """`labels`: what the objects carry (by default the operator's label; {}: every object)."""
        self.kube, self.kind, self.store, self.on_change = kube, kind, store, on_change
        self.labels = MANAGED_BY if labels is None else labels
        self.trim = TRIM.get(kind, lambda obj: obj)
        self.namespaces = namespaces or [None]
        self.synced = asyncio.Event()  # every namespace listed once
        self.absent: bool | None = None  # an OPTIONAL_WATCHED kind the API does not serve (None: not known yet)
        self._listed: set[str | None] = set()

    async def run(self) -> None:
        await asyncio.gather(*(self._namespace(ns) for ns in self.namespaces))

    async def _namespace(self, namespace: str | None) -> None:
        failures = 0
        while True:
            try:
                version = await self._list(namespace)
                failures = 0
                await self._watch(namespace, version)
            except Gone:  # compacted away while we were not looking: list again, at once
                continue
            except Exception as e:  # noqa: BLE001 - an informer never gives up; it lists again
                if isinstance(e, NotFound) and self.kind in OPTIONAL_WATCHED:  # the CRD is not installed
                    failures = 0
                    self._absent(namespace, e)
                    await asyncio.sleep(ABSENT_RECHECK_S * random.uniform(0.8, 1.2))
                    continue
                failures += 1
                wait = getattr(e, "retry_after", None) or min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (failures - 1))
                log.warning("watching %s: %s; listing again in %.1f s", self.kind, e, wait)
                await asyncio.sleep(wait * random.uniform(0.8, 1.2))

    def _absent(self, namespace: str | None, error: Exception) -> None:
        """The API does not serve this kind (its CRD is not installed, or was deleted, which
        deletes every object of it): none exists."""
        if self.absent is not True:
            log.info("%s is not served by this cluster (%s): its CRD is not installed; services that do not ask for "
                     "one are unaffected; checking again every %.0f s", self.kind, error, ABSENT_RECHECK_S)
        self.absent = self.store.absent = True
        before = {k for k in self.store.objects if namespace is None or k[0] == namespace}
        self.store.replace(namespace, [])
        for k in before:
            self.on_change(self.kind, "DELETED", {"metadata": {"namespace": k[0], "name": k[1]}})
        self._listed.add(namespace)
        if len(self._listed) == len(self.namespaces):
            self.synced.set()

    async def _list(self, namespace: str | None) -> str | None:
        # The first list from the API server's watch cache; a list again, consistent (it must not
        # go back before what the copies already hold).
        objects, version = await self.kube.list_versioned(self.kind, namespace, self.labels,
                                                          cached=namespace not in self._listed)
        objects = [self.trim(o) for o in objects]
        if self.absent:
            log.info("%s is served by this cluster now (its CRD was installed)", self.kind)
        self.absent = self.store.absent = False
        before = {k for k in self.store.objects if namespace is None or k[0] == namespace}
        self.store.replace(namespace, objects)
        for k in before - set(self.store.objects):  # deleted while we were not watching
            self.on_change(self.kind, "DELETED", {"metadata": {"namespace": k[0], "name": k[1]}})
        for obj in objects:
            self.on_change(self.kind, "LISTED", obj)
        self._listed.add(namespace)
        if len(self._listed) == len(self.namespaces):
            self.synced.set()
        return version

    async def _watch(self, namespace: str | None, version: str | None) -> None:
        """Until the stream fails. Each stream is bounded in time, so a connection that died
        without a word (no FIN, no RST) is noticed; it resumes from the last version seen."""
        while True:
            try:
                async with asyncio.timeout(WATCH_TIMEOUT_S + 30):
                    async for kind, obj in self.kube.watch(self.kind, namespace, self.labels, version, WATCH_TIMEOUT_S):
                        version = (obj.get("metadata") or {}).get("resourceVersion") or version
                        if kind == "BOOKMARK":
                            continue
                        obj = self.trim(obj)
                        if kind == "DELETED":
                            self.store.drop(*key_of(obj))
                        else:
                            self.store.put(obj)
                        self.on_change(self.kind, kind, obj)
            except TimeoutError:
                continue


class Cluster:
    """The operator's reads (the stores first) and writes (the API, after the leader check)."""

    def __init__(self, kube: Kube, stores: dict[str, Store], may_write: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic):
        self.kube, self.stores, self.may_write, self.clock = kube, stores, may_write, clock
        # What this operator applied to each owned object and whether it stuck (drift.Applied), by
        # (kind, namespace, name): the reconcile holds a render the API server does not keep as sent.
        self.applied: dict[tuple[str, str, str], drift.Applied] = {}
        # Objects (by uid) whose adoption (write.adopted) was refused, and until when it is not tried.
        self.unadopted: dict[str, float] = {}
        # Services (namespace, name) whose KEDA HPA was asked to be rebuilt (reconcile_keda._rebuild).
        self.rebuilt: dict[tuple[str, str], tuple[float, int]] = {}  # (when, how many times)
        # Kinds whose copies are complete only once their informer has listed them (Informer.synced):
        # before (a list refused: RBAC), an absence is read from the API, not trusted.
        self.listed: dict[str, asyncio.Event] = {}
        # Informers started at the first read of their kind (UNLABELLED), by kind; their tasks,
        # and until when (the event loop's clock) a read waits for their first list.
        self.on_demand: dict[str, Informer] = {}
        self.tasks: list[asyncio.Task] = []
        self._demanded: dict[str, float] = {}

    async def get(self, kind: str, namespace: str, name: str, fresh: bool = False, ours: bool = False) -> dict | None:
        """`ours`: only an object of ours matters (one the watch would show): a copy's absence is
        the answer, no API read (once the kind's informer has listed it, where `listed` knows)."""
        if kind in self.on_demand:
            await self._demand(kind)
        store = self.stores.get(kind)
        trusted = ours and (kind not in self.listed or self.listed[kind].is_set())
        if store is not None and not fresh and ((obj := store.get(namespace, name)) is not None or trusted):
            return obj
        obj = await self.kube.get(kind, namespace, name)
        if store is not None:
            if obj is None:
                store.drop(namespace, name)
            elif kind not in WATCHED or _ours(obj):  # a watch would show it: keep it
                store.put(obj)
        return obj

    async def _demand(self, kind: str) -> None:
        """Start `kind`'s informer at its first read, and wait (DEMAND_WAIT_S from its start, at most)
        for its first list: until then a copy's absence means nothing, and each read is a GET."""
        loop, informer = asyncio.get_running_loop(), self.on_demand[kind]
        if kind not in self._demanded:
            self._demanded[kind] = loop.time() + DEMAND_WAIT_S
            self.listed[kind] = informer.synced
            self.tasks.append(asyncio.create_task(informer.run(), name=f"informer:{kind}"))
        if not informer.synced.is_set() and (left := self._demanded[kind] - loop.time()) > 0:
            try:
                await asyncio.wait_for(informer.synced.wait(), left)
            except TimeoutError:
                pass

    def serves(self, kind: str) -> bool:
        """Whether the API serves `kind` (its CRD installed), as far as its informer knows: not known
        yet counts as served (a write then tells: 404)."""
        store = self.stores.get(kind)
        return store is None or store.absent is not True

    def pods(self, namespace: str, labels: dict) -> list[dict]:
        return self.select("Pod", namespace, labels)

    def select(self, kind: str, namespace: str, labels: dict) -> list[dict]:
        """The copies of a watched kind (ours: the operator's label; all, of WATCHED_WHOLE) that carry `labels`."""
        return self.stores[kind].select(namespace, labels) if kind in self.stores else []

    def _check(self, what: str) -> None:
        if not self.may_write():
            raise NotLeader(f"{what}: this operator pod does not hold the lease")

    def _keep(self, kind: str, obj: dict) -> dict:
        if kind in self.stores and obj.get("metadata", {}).get("name"):
            self.stores[kind].put(obj)
        return obj

    async def apply(self, obj: dict, **kwargs) -> dict:
        self._check(f"apply {obj['kind']}/{obj['metadata']['name']}")
        return self._keep(obj["kind"], await self.kube.apply(obj, **kwargs))

    async def create(self, obj: dict) -> dict:
        """Create `obj`: Conflict (409) when an object of its name exists, someone else's or ours."""
        self._check(f"create {obj['kind']}/{obj['metadata']['name']}")
        return self._keep(obj["kind"], await self.kube.create(obj))

    async def json_patch(self, kind: str, namespace: str, name: str, operations: list[dict]) -> dict:
        self._check(f"patch {kind}/{name}")
        return self._keep(kind, await self.kube.json_patch(kind, namespace, name, operations))

    async def delete(self, kind: str, namespace: str, name: str, **kwargs) -> None:
        self._check(f"delete {kind}/{name}")
        await self.kube.delete(kind, namespace, name, **kwargs)
        if kind in self.stores:
            self.stores[kind].drop(namespace, name)
        self.applied.pop((kind, namespace, name), None)

    async def patch_status(self, namespace: str, name: str, status: dict, resource_version: str) -> dict:
        self._check(f"status of {name}")
        return self._keep(crd.KIND, await self.kube.patch_status(namespace, name, status, resource_version))

    async def patch_scale(self, namespace: str, name: str, replicas: int, resource_version: str) -> None:
        self._check(f"scale of {name}")
        scale = await self.kube.patch_scale(namespace, name, replicas, resource_version)
        store = self.stores.get(crd.KIND)
        copy = store.get(namespace, name) if store is not None else None
        if copy is not None and scale and copy["metadata"].get("resourceVersion") == resource_version:
            # The Scale answers with the service's new resourceVersion: the copy the write was
            # computed from follows (unless a watch event has replaced it already), so the status
            # write that comes next is not refused as stale.
            meta = {**copy["metadata"], "resourceVersion": scale["metadata"]["resourceVersion"]}
            if copy["metadata"].get("generation") is not None:
                meta["generation"] = copy["metadata"]["generation"] + 1
            store.put({**copy, "metadata": meta, "spec": {**copy.get("spec", {}), "replicas": replicas}})

    async def scale_deployment(self, namespace: str, name: str, replicas: int, resource_version: str) -> None:
        self._check(f"scale of Deployment/{name}")
        await self.kube.scale_deployment(namespace, name, replicas, resource_version)

    async def annotate(self, kind: str, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Merge `annotations` into an object's (a merge patch without a precondition: only these
        keys change, whatever else did meanwhile)."""
        self._check(f"annotations of {kind}/{name}")
        self._keep(kind, await self.kube.merge_patch(kind, namespace, name, {"metadata": {"annotations": annotations}}))


def _older(obj: dict, than: dict) -> bool:
    a, b = ((o.get("metadata") or {}).get("resourceVersion") or "" for o in (obj, than))
    return a.isdigit() and b.isdigit() and int(a) < int(b)


def _ours(obj: dict) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in MANAGED_BY.items())

