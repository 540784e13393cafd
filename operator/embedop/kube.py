"""The Kubernetes API calls the operator makes, over lightkube's async client, and nothing else
(the chart's RBAC mirrors CALLS; a test compares).

Owned objects are written with server-side apply under one field manager, forced (the operator is
the only intended writer of the fields it sends). Bodies stay plain dicts: lightkube's typed models
drop fields they do not know on conversion, and the rendered dicts are validated against the real
schemas in the tests. Errors are sorted for the callers:

- Conflict: a resourceVersion precondition failed (HTTP 409): re-read and try again;
- Retryable: anything transient (timeouts, refused connections, 408/425/429/5xx);
- Rejected: the API refused the request for good (400/403/422; NotFound for 404), with its
  message, which the status reports as Degraded.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import httpx2
from lightkube import ALL_NS, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import Pod, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import CascadeType, PatchType

from embedop import crd

FIELD_MANAGER = "embedop"
# Applies only spec.replicas once, before the first apply without it (mode hpa): the count keeps an
# owner until the HorizontalPodAutoscaler writes it (Kubernetes' "transferring ownership" recipe).
HANDOVER_MANAGER = "embedop-handover"

EmbeddingService = create_namespaced_resource(crd.GROUP, crd.VERSION, crd.KIND, crd.PLURAL)
RESOURCES = {
    "Deployment": (Deployment, "apps", "deployments"),
    "Service": (Service, "", "services"),
    "PodDisruptionBudget": (PodDisruptionBudget, "policy", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": (HorizontalPodAutoscaler, "autoscaling", "horizontalpodautoscalers"),
    "Pod": (Pod, "", "pods"),
    crd.KIND: (EmbeddingService, crd.GROUP, crd.PLURAL),
}

# Every (group, resource, verb) the operator calls, as RBAC sees it; tests check the chart against it.
CALLS = {
    # get: the live object (count, resourceVersion); patch: server-side apply, which the API
    # authorizes as create when the object does not exist yet.
    *((RESOURCES[k][1], RESOURCES[k][2], v) for k in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler")
      for v in ("get", "create", "patch")),
    ("autoscaling", "horizontalpodautoscalers", "delete"),  # when a service leaves hpa mode
    ("", "pods", "list"),  # the autoscaler's scrape targets
    ("apps", "deployments", "list"),  # kopf watches the Deployments to follow their status
    ("apps", "deployments", "watch"),
    (crd.GROUP, crd.PLURAL, "get"),  # a fresh read before every write
    (crd.GROUP, crd.PLURAL, "list"),  # kopf: watching, and its annotations
    (crd.GROUP, crd.PLURAL, "watch"),
    (crd.GROUP, crd.PLURAL, "patch"),
    (crd.GROUP, f"{crd.PLURAL}/status", "patch"),
    # Modes operator and hpa: spec.replicas mirrors the live count (reconcile.mirror_count).
    (crd.GROUP, f"{crd.PLURAL}/scale", "patch"),
    # ownerReferences with blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission
    # plugin (OpenShift, hardened clusters) requires update on the owner's finalizers subresource.
    (crd.GROUP, f"{crd.PLURAL}/finalizers", "update"),
    ("", "events", "create"),  # kopf.info / kopf.warn
}

RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class Retryable(RuntimeError):
    """A transient API failure: try again later."""


class Conflict(Retryable):
    """409: the object changed since it was read (or another manager owns a field): re-read."""


class Rejected(RuntimeError):
    """The API refused the request for good (invalid object, forbidden by admission)."""


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


@contextlib.asynccontextmanager
async def _errors(what: str) -> AsyncIterator[None]:
    try:
        yield
    except httpx2.HTTPStatusError as e:  # lightkube's ApiError is one, when the answer is a Status
        code = e.response.status_code
        message = f"{what}: {_message(e.response)}"
        if code == 409:
            raise Conflict(message) from e
        if code == 404:
            raise NotFound(message) from e
        if code in RETRYABLE:
            raise Retryable(message) from e
        raise Rejected(message) from e
    except httpx2.TransportError as e:  # refused, reset, timed out
        raise Retryable(f"{what}: {type(e).__name__}: {e}") from e


def _plain(obj: Any) -> dict:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


class Kube:
    def __init__(self, client: AsyncClient):
        self.client = client

    @classmethod
    def connect(cls, timeout_s: float = 10.0) -> "Kube":
        """Configured the way kubectl is: in-cluster service account, else KUBECONFIG/~/.kube/config."""
        return cls(AsyncClient(timeout=httpx2.Timeout(timeout_s)))

    async def close(self) -> None:
        await self.client.close()

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            async with _errors(f"get {kind}/{name}"):
                return _plain(await self.client.get(RESOURCES[kind][0], name, namespace=namespace))
        except NotFound:
            return None

    async def list(self, kind: str, namespace: str | None, labels: dict | None = None) -> list[dict]:
        """namespace None: all namespaces."""
        async with _errors(f"list {kind}"):
            return [_plain(o) async for o in self.client.list(RESOURCES[kind][0], namespace=namespace or ALL_NS,
                                                               labels=labels)]

    async def apply(self, obj: dict, manager: str = FIELD_MANAGER, force: bool = True) -> dict:
        """Server-side apply: the object gets exactly the fields `manager` sends (those it sent before
        and no longer does are removed unless another manager owns them). A metadata.resourceVersion
        in `obj` is a precondition: the API answers 409 (Conflict) when the object has changed since."""
        kind, meta = obj["kind"], obj["metadata"]
        async with _errors(f"apply {kind}/{meta['name']}"):
            out = await self.client.patch(RESOURCES[kind][0], meta["name"], obj, namespace=meta["namespace"],
                                          patch_type=PatchType.APPLY, field_manager=manager, force=force)
        return _plain(out)

    async def delete(self, kind: str, namespace: str, name: str, foreground: bool = False) -> None:
        """Foreground: the object stays (deletionTimestamp set) until the garbage collector has
        deleted its dependents that block it (ownerReferences with blockOwnerDeletion)."""
        try:
            async with _errors(f"delete {kind}/{name}"):
                await self.client.delete(RESOURCES[kind][0], name, namespace=namespace,
                                         cascade=CascadeType.FOREGROUND if foreground else None)
        except NotFound:
            pass

    async def set_finalizers(self, namespace: str, name: str, finalizers: list[str], resource_version: str) -> None:
        """Replace the service's finalizers, guarded by the resourceVersion they were read at."""
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}}
        async with _errors(f"patch {crd.KIND}/{name} finalizers"):
            await self.client.patch(EmbeddingService, name, body, namespace=namespace, patch_type=PatchType.MERGE,
                                          field_manager=FIELD_MANAGER)

    async def patch_scale(self, namespace: str, name: str, replicas: int, resource_version: str) -> None:
        """Merge-patch the service's spec.replicas through its scale subresource, guarded: for a
        custom resource the API server takes the Scale's resourceVersion as the precondition of
        the update (409 when the service has changed since). Only spec.replicas can change this
        way, and RBAC can grant it alone."""
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        async with _errors(f"patch {crd.KIND}/{name}/scale"):
            await self.client.patch(EmbeddingService.Scale, name, body, namespace=namespace, patch_type=PatchType.MERGE,
                                          field_manager=FIELD_MANAGER)

    async def patch_status(self, namespace: str, name: str, status: dict, resource_version: str) -> dict:
        """Merge-patch the service's status, guarded: the patch carries the resourceVersion it was
        computed from, so a write based on a stale read fails with Conflict instead of undoing
        another writer's fields."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        async with _errors(f"patch {crd.KIND}/{name}/status"):
            out = await self.client.patch(EmbeddingService.Status, name, body, namespace=namespace,
                                          patch_type=PatchType.MERGE,
                                          field_manager=FIELD_MANAGER)
        return _plain(out)
