"""The Kubernetes API calls the operator makes, over lightkube's async client, and nothing else
(the chart's RBAC mirrors CALLS; a test compares).

Owned objects are written with server-side apply under one field manager, forced (the operator is
the only intended writer of the fields it sends). Bodies stay plain dicts, read and written through
lightkube's generic resources: its typed models drop fields they do not know and refuse an object
that lacks a field they require (one odd Pod would stop a whole watch), and the rendered dicts are
validated against the real schemas in the tests. Errors are sorted for the callers:

- Conflict: a resourceVersion precondition failed (HTTP 409): re-read and try again;
- Retryable: anything transient (timeouts, refused connections, 408/425/429/5xx);
- Rejected: the API refused the request for good (400/403/422; NotFound for 404), with its
  message, which the status reports as Degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import httpx2
from lightkube import ALL_NS, AsyncClient, codecs
from lightkube.core.generic_client import ListAsyncIterable
from lightkube.core.selector import build_selector
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import CascadeType, PatchType, on_error_raise

from embedop import crd, render_gateway, render_keda

FIELD_MANAGER = "embedop"
# Applies only spec.replicas once, before the first apply without it (mode hpa): the count keeps an
# owner until the HorizontalPodAutoscaler writes it (Kubernetes' "transferring ownership" recipe).
HANDOVER_MANAGER = "embedop-handover"

# kind → (group, version, plural): every kind the operator reads or writes, as generic (dict) resources.
KINDS = {
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("", "v1", "services"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    # spec.routing gateway (render_gateway); its CRD may not be installed (cache.OPTIONAL_WATCHED).
    render_gateway.KIND: (render_gateway.GROUP, render_gateway.VERSION, render_gateway.PLURAL),
    # autoscaling.mode keda (render_keda): KEDA's ScaledObject, its HTTP add-on's routes; their CRDs
    # may not be installed either.
    **render_keda.KINDS,
    "Pod": ("", "v1", "pods"),
    "Job": ("batch", "v1", "jobs"),  # a pre-filled model cache's fill (render_cache)
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),  # spec.modelCache.claimName: read only
    "Lease": ("coordination.k8s.io", "v1", "leases"),
    crd.KIND: (crd.GROUP, crd.VERSION, crd.PLURAL),
}
RESOURCES = {kind: (create_namespaced_resource(group, version, kind, plural), group, plural)
             for kind, (group, version, plural) in KINDS.items()}
EmbeddingService = RESOURCES[crd.KIND][0]
Deployment = RESOURCES["Deployment"][0]

# Every (group, resource, verb) the operator calls, as RBAC sees it, each once (a test compares the
# chart's rules with this list, duplicates included); CALLS is the same as a set.
CALL_LIST = (
    # get: the live object (count, resourceVersion); create: an object that does not exist yet
    # (never by apply, which would take over one made meanwhile); patch: server-side apply of
    # what is ours, and once after a create, our field manager's entry made an apply's.
    *((RESOURCES[k][1], RESOURCES[k][2], v) for k in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                                      "NetworkPolicy", render_gateway.KIND)
      for v in ("get", "create", "patch")),
    ("autoscaling", "horizontalpodautoscalers", "delete"),  # when a service leaves hpa mode
    ("networking.k8s.io", "networkpolicies", "delete"),  # when a service's networkPolicy is disabled
    (render_gateway.GROUP, render_gateway.PLURAL, "delete"),  # when a service's routing goes back to service
    # Mode keda: the ScaledObject and the HTTP add-on's routes, as the other owned objects; delete:
    # when a service leaves mode keda, or stops scaling to zero (the routes), or the add-on changes.
    *((RESOURCES[k][1], RESOURCES[k][2], v) for k in render_keda.KINDS for v in ("get", "create", "patch", "delete")),
    # The owned kinds are listed and watched by the operator's label (cache.py): the reconcile
    # and the autoscaler read those copies, never the API, while nothing changes.
    *((RESOURCES[k][1], RESOURCES[k][2], v) for k in ("Deployment", "Pod", "Service", "PodDisruptionBudget",
                                                      "HorizontalPodAutoscaler", "NetworkPolicy", render_gateway.KIND,
                                                      *render_keda.KINDS)
      for v in ("list", "watch")),
    # Server pods: the ones a scale-down is to remove marked with the lowest pod-deletion-cost
    # (autoscale.removal_marks; the ReplicaSet then removes those), stale marks cleared.
    ("", "pods", "patch"),
    # The count through the scale subresource when admission refuses the whole Deployment.
    ("apps", "deployments/scale", "patch"),
    # spec.modelCache.prefill: the fill Job, created once per model revision and claim (never
    # changed: its pod template is immutable), watched by the operator's label for its completion,
    # and those of earlier revisions deleted once a later one has succeeded.
    *(("batch", "jobs", v) for v in ("get", "create", "list", "watch", "delete")),
    # spec.modelCache.claimName: the claims' access modes and uid (a claim re-created empty is filled
    # again), read from a watch of the served namespaces' claims (cache.UNLABELLED), never written;
    # get: only while they have not been listed (a claim not in the copy then is read by name).
    *(("", "persistentvolumeclaims", v) for v in ("get", "list", "watch")),
    # Leader election (leader.py), in the operator's own namespace: create unnamed (RBAC cannot
    # name what does not exist yet), get and patch of the one Lease by name (the chart's
    # resourceNames).
    *(("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")),
    # scope.py, once at start-up: the other operators' claims on namespaces (Leases the chart labels),
    # across the cluster, label-selected.
    ("coordination.k8s.io", "leases", "list"),
    (crd.GROUP, crd.PLURAL, "get"),  # a fresh read before every write
    (crd.GROUP, crd.PLURAL, "list"),  # kopf: watching
    (crd.GROUP, crd.PLURAL, "watch"),
    # No patch of the services themselves: the operator writes their status and scale subresources
    # only (the finalizer that operators before 0.1.1 set, and 0.2.x took off, is gone).
    (crd.GROUP, f"{crd.PLURAL}/status", "patch"),
    # Modes operator and hpa: spec.replicas mirrors the live count (reconcile.mirror_count).
    (crd.GROUP, f"{crd.PLURAL}/scale", "patch"),
    # ownerReferences with blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission
    # plugin (OpenShift, hardened clusters) requires update on the owner's finalizers subresource.
    (crd.GROUP, f"{crd.PLURAL}/finalizers", "update"),
    ("", "events", "create"),  # kopf.info / kopf.warn
)
CALLS = frozenset(CALL_LIST)

RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class Retryable(RuntimeError):
    """A transient API failure: try again later (`retry_after` seconds, when the API said so)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Gone(Retryable):
    """410: a watch's resourceVersion is too old (compacted away): list again."""


class Conflict(Retryable):
    """409: the object changed since it was read (or another manager owns a field): re-read."""


class Rejected(RuntimeError):
    """The API refused the request for good (invalid object, forbidden by admission); `code`: its
    HTTP status, where there was one (422 is a JSON patch's failed `test`, but also an invalid
    object and a ValidatingAdmissionPolicy's default refusal)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class NotFound(Rejected):
    """404: the object (or its namespace) does not exist."""


def _message(response: httpx2.Response) -> str:
    """The API's message (from its Status object), else the body's start (e.g. a proxy's page)."""
    try:
        status = response.json()
    except ValueError:
        status = None
    if isinstance(status, dict) and (status.get("message") or status.get("reason")):
        return status.get("message") or status["reason"]
    return response.text[:300] or str(response.status_code)


def _retry_after(response: httpx2.Response) -> float | None:
    """The seconds a 429 (API Priority and Fairness) or 503 asks us to wait, when it says."""
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


@contextlib.asynccontextmanager
async def _errors(what: str, total_s: float | None = None) -> AsyncIterator[None]:
    """The API's errors sorted (see the module's docstring); `total_s`: the most the whole call may
    take (the client's own timeout is per phase: connecting, writing, waiting and reading could
    each take it, one after another)."""
    try:
        async with asyncio.timeout(total_s):
            yield
    except TimeoutError as e:  # ours: the client's own are TransportErrors
        raise Retryable(f"{what}: no answer within {total_s:g} s") from e
    except httpx2.HTTPStatusError as e:  # lightkube's ApiError is one, when the answer is a Status
        if e.response is None:  # an ERROR event inside a watch stream (HTTP 200): its Status says
            status = getattr(e, "status", None)
            code, message = getattr(status, "code", None) or 500, f"{what}: {getattr(status, 'message', e)}"
            raise (Gone if code == 410 else Retryable)(message) from e
        code = e.response.status_code
        message = f"{what}: {_message(e.response)}"
        if code == 409:
            raise Conflict(message) from e
        if code == 404:
            raise NotFound(message, code) from e
        if code == 410:
            raise Gone(message) from e
        if code in RETRYABLE:
            raise Retryable(message, _retry_after(e.response)) from e
        raise Rejected(message, code) from e
    except httpx2.TransportError as e:  # refused, reset, timed out
        raise Retryable(f"{what}: {type(e).__name__}: {e}") from e


def _plain(obj: Any) -> dict:
    """A deep copy as plain dicts: a generic resource is a dict of plain values; a subresource's
    answer (a Scale) is lightkube's model of it."""
    return json.loads(json.dumps(obj)) if isinstance(obj, dict) else obj.to_dict()


class Kube:
    def __init__(self, client: AsyncClient, timeout_s: float | None = None):
        """`timeout_s`: the most a call may take in all (its reads and writes; lists and watches,
        which stream, are bounded by the client's timeout per phase only)."""
        self.client, self.timeout_s = client, timeout_s

    @classmethod
    def connect(cls, timeout_s: float = 10.0) -> "Kube":
        """Configured the way kubectl is: in-cluster service account, else KUBECONFIG/~/.kube/config."""
        return cls(AsyncClient(timeout=httpx2.Timeout(timeout_s)), timeout_s)

    def _call(self, what: str):
        return _errors(what, self.timeout_s)

    async def close(self) -> None:
        await self.client.close()

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            async with self._call(f"get {kind}/{name}"):
                return _plain(await self.client.get(RESOURCES[kind][0], name, namespace=namespace))
        except NotFound:
            return None

    async def list(self, kind: str, namespace: str | None, labels: dict | None = None) -> list[dict]:
        """namespace None: all namespaces."""
        async with _errors(f"list {kind}"):
            return [_plain(o) async for o in self.client.list(RESOURCES[kind][0], namespace=namespace or ALL_NS,
                                                               labels=labels)]

    def _collection(self, kind: str, namespace: str | None, params: dict, watch: bool = False):
        """lightkube's own request for a list or a watch, with the parameters its list() and
        watch() do not take (resourceVersion on a list, allowWatchBookmarks): its request
        building, through its generic client (lightkube is pinned; a test runs both)."""
        return self.client._client.prepare_request("list", res=RESOURCES[kind][0], namespace=namespace or ALL_NS,
                                                   watch=watch, params=params)

    async def list_versioned(self, kind: str, namespace: str | None, labels: dict,
                             cached: bool = True) -> tuple[list[dict], str | None]:
        """→ (the objects matching `labels` server-side, the list's resourceVersion: where a watch
        of changes since starts). namespace None: all namespaces. `cached`: resourceVersion=0, as
        client-go's reflector lists first: served from the API server's watch cache, not read from
        etcd (a label-selected list is otherwise a range read of every pod of the cluster,
        filtered); but a watch cache may lag what was already seen, so a list again (after a 410)
        is a consistent read."""
        params = {"labelSelector": build_selector(labels), **({"resourceVersion": "0"} if cached else {})}
        br = self._collection(kind, namespace, params)
        async with _errors(f"list {kind}"):
            listing = ListAsyncIterable(self.client._client.list_chunks(br))
            objects = [_plain(o) async for o in listing]
            try:
                version = listing.resourceVersion
            except Exception:  # noqa: BLE001 - lightkube's NotReadyError on an empty list's first page
                version = None
        return objects, version

    async def watch(self, kind: str, namespace: str | None, labels: dict, version: str | None,
                    timeout_s: int) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) of the changes since `version`, matching `labels` server-side,
        until the API server ends the stream after `timeout_s` (lightkube then resumes it from the
        last version seen) or it fails (Gone: list again). With bookmarks: the API server sends a
        quiet watch fresh versions, so resuming it does not fall behind the compaction (a 410
        and a list again every few minutes, for every kind a fleet rarely changes)."""
        br = self._collection(kind, namespace, {"labelSelector": build_selector(labels), "resourceVersion": version,
                                                "timeoutSeconds": timeout_s, "allowWatchBookmarks": "true"}, watch=True)
        async with _errors(f"watch {kind}"):
            async for event, obj in self.client._client.watch(br, on_error=on_error_raise):
                yield event, _plain(obj)

    async def create(self, obj: dict) -> dict:
        """Create `obj` (under our field manager); Conflict (409 AlreadyExists) when it exists."""
        async with self._call(f"create {obj['kind']}/{obj['metadata']['name']}"):
            return _plain(await self.client.create(codecs.from_dict(obj), namespace=obj["metadata"].get("namespace"),
                                                   field_manager=FIELD_MANAGER))

    async def json_patch(self, kind: str, namespace: str, name: str, operations: list[dict]) -> dict:
        """A JSON patch (RFC 6902): its `test` operations are preconditions (Rejected, 422, when
        one fails)."""
        async with self._call(f"patch {kind}/{name}"):
            return _plain(await self.client.patch(RESOURCES[kind][0], name, operations, namespace=namespace,
                                                  patch_type=PatchType.JSON, field_manager=FIELD_MANAGER))

    async def merge_patch(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        """A merge patch; a metadata.resourceVersion in `body` is a precondition (409 when stale)."""
        async with self._call(f"patch {kind}/{name}"):
            return _plain(await self.client.patch(RESOURCES[kind][0], name, body, namespace=namespace,
                                                  patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER))

    async def apply(self, obj: dict, manager: str = FIELD_MANAGER, force: bool = True) -> dict:
        """Server-side apply: the object gets exactly the fields `manager` sends (those it sent before
        and no longer does are removed unless another manager owns them). A metadata.resourceVersion
        in `obj` is a precondition: the API answers 409 (Conflict) when the object has changed since."""
        kind, meta = obj["kind"], obj["metadata"]
        async with self._call(f"apply {kind}/{meta['name']}"):
            out = await self.client.patch(RESOURCES[kind][0], meta["name"], obj, namespace=meta["namespace"],
                                          patch_type=PatchType.APPLY, field_manager=manager, force=force)
        return _plain(out)

    async def delete(self, kind: str, namespace: str, name: str, foreground: bool = False,
                     background: bool = False) -> None:
        """Foreground: the object stays (deletionTimestamp set) until the garbage collector has
        deleted its dependents that block it (ownerReferences with blockOwnerDeletion).
        Background: it goes now and the collector deletes its dependents after (a Job's own
        default, kept by batch/v1 for compatibility, is to orphan its pods)."""
        cascade = CascadeType.FOREGROUND if foreground else CascadeType.BACKGROUND if background else None
        try:
            async with self._call(f"delete {kind}/{name}"):
                await self.client.delete(RESOURCES[kind][0], name, namespace=namespace, cascade=cascade)
        except NotFound:
            pass

    async def patch_scale(self, namespace: str, name: str, replicas: int, resource_version: str) -> dict:
        """Merge-patch the service's spec.replicas through its scale subresource, guarded: for a
        custom resource the API server takes the Scale's resourceVersion as the precondition of
        the update (409 when the service has changed since). Only spec.replicas can change this
        way, and RBAC can grant it alone."""
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        async with self._call(f"patch {crd.KIND}/{name}/scale"):
            return _plain(await self.client.patch(EmbeddingService.Scale, name, body, namespace=namespace,
                                                  patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER))

    async def scale_deployment(self, namespace: str, name: str, replicas: int, resource_version: str) -> None:
        """Merge-patch a Deployment's count through its scale subresource, guarded by the
        Deployment's resourceVersion. Admission webhooks that judge Deployments (Kyverno,
        Gatekeeper) see a Scale here, not the pod template, so the count can change while an
        apply of the whole spec is refused. The API records it as an Update of spec.replicas by
        our manager, which the next accepted apply (which sends the count) takes back."""
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        async with self._call(f"patch Deployment/{name}/scale"):
            await self.client.patch(Deployment.Scale, name, body, namespace=namespace, patch_type=PatchType.MERGE,
                                    field_manager=FIELD_MANAGER)

    async def patch_status(self, namespace: str, name: str, status: dict, resource_version: str) -> dict:
        """Merge-patch the service's status, guarded: the patch carries the resourceVersion it was
        computed from, so a write based on a stale read fails with Conflict instead of undoing
        another writer's fields."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        async with self._call(f"patch {crd.KIND}/{name}/status"):
            out = await self.client.patch(EmbeddingService.Status, name, body, namespace=namespace,
                                          patch_type=PatchType.MERGE,
                                          field_manager=FIELD_MANAGER)
        return _plain(out)
