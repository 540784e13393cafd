"""Kubernetes API calls the operator makes, and nothing else (the chart's RBAC mirrors CALLS).

Written for a real API server: objects are created or updated with server-side apply (one
field manager, forced), falling back to create when the apply answers 404 (older servers and
emulators) and back to apply when a racing create answers 409. Errors worth retrying raise
Retryable; the handlers turn it into kopf.TemporaryError."""

from __future__ import annotations

import json
from typing import Any

import urllib3

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from embedop import crd

FIELD_MANAGER = "embedop"

PATHS = {  # kind → (collection path, RBAC group, resource)
    "Deployment": ("/apis/apps/v1/namespaces/{namespace}/deployments", "apps", "deployments"),
    "Service": ("/api/v1/namespaces/{namespace}/services", "", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", "policy", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers", "autoscaling", "horizontalpodautoscalers"),
    "Pod": ("/api/v1/namespaces/{namespace}/pods", "", "pods"),
    crd.KIND: (f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{namespace}}/{crd.PLURAL}", crd.GROUP, crd.PLURAL),
}

# Every (group, resource, verb) this module can call; tests check the chart's RBAC against it.
CALLS = {
    *((PATHS[k][1], PATHS[k][2], v) for k in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler")
      for v in ("get", "create", "patch")),
    ("autoscaling", "horizontalpodautoscalers", "delete"),  # when a service leaves hpa mode
    ("", "pods", "list"),
    ("apps", "deployments", "list"),  # kopf watches the Deployments to follow their status
    ("apps", "deployments", "watch"),
    (crd.GROUP, crd.PLURAL, "list"),  # kopf: watching, finalizers and its annotations
    (crd.GROUP, crd.PLURAL, "watch"),
    (crd.GROUP, crd.PLURAL, "patch"),
    ("", "events", "create"),  # kopf.warn / kopf.info
    ("apps", "deployments/scale", "patch"),
    (crd.GROUP, crd.PLURAL, "get"),
    (crd.GROUP, f"{crd.PLURAL}/status", "patch"),
}

RETRYABLE = {408, 409, 425, 429, 500, 502, 503, 504}


class Retryable(RuntimeError):
    """A transient API failure: try the whole reconcile again later."""


def connect() -> None:
    """Configure the client the way kubectl would: in-cluster, else KUBECONFIG/~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    def __init__(self, api: client.ApiClient | None = None, timeout_s: float = 10.0):
        self.api = api or client.ApiClient()
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None,
              query: list | None = None) -> dict | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            data = self.api.call_api(
                path, method, query_params=query or [], header_params=headers, body=body,
                response_types_map={200: "object", 201: "object"}, auth_settings=["BearerToken"],
                _return_http_data_only=True, _preload_content=False, _request_timeout=self.timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            if e.status in RETRYABLE:
                raise Retryable(f"{method} {path}: {e.status} {e.reason}") from e
            raise
        except (OSError, urllib3.exceptions.HTTPError) as e:  # refused, reset, timed out
            raise Retryable(f"{method} {path}: {e}") from e
        raw = data.data if hasattr(data, "data") else data
        return json.loads(raw) if raw else {}

    @staticmethod
    def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        path = PATHS[kind][0].format(namespace=namespace)
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self._call("GET", self._path(kind, namespace, name))

    def apply(self, obj: dict) -> dict:
        """Create or update `obj` to exactly our fields (server-side apply, forced)."""
        kind, meta = obj["kind"], obj["metadata"]
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        path = self._path(kind, meta["namespace"], meta["name"])
        try:
            out = self._call("PATCH", path, obj, "application/apply-patch+yaml", query)
        except ApiException as e:
            if e.status != 415:  # no server-side apply here: merge-patch is the next best thing
                raise
            out = self._call("PATCH", path, obj, "application/merge-patch+json")
        if out is not None:
            return out
        try:  # 404: the object does not exist and this server does not create on apply
            created = self._call("POST", self._path(kind, meta["namespace"]), obj, "application/json",
                                 [("fieldManager", FIELD_MANAGER)])
        except Retryable as e:
            if "409" not in str(e):
                raise
            # Somebody created it since our apply: now the apply updates it.
            created = self._call("PATCH", path, obj, "application/apply-patch+yaml", query)
        return created or {}

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._call("DELETE", self._path(kind, namespace, name))

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        out = self._call("GET", self._path("Pod", namespace), query=[("labelSelector", label_selector)])
        return (out or {}).get("items", [])

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self._call("PATCH", self._path("Deployment", namespace, name, "scale"),
                   {"spec": {"replicas": replicas}}, "application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, status: dict) -> dict | None:
        return self._call("PATCH", self._path(crd.KIND, namespace, name, "status"),
                          {"status": status}, "application/merge-patch+json")
