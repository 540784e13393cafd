"""kmock's KubernetesEmulator on its own thread and loop, a kubeconfig pointing at it, and a tiny
JSON client the tests use to act as kubectl would (independent of the operator's own code)."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import attrs
import kmock

from embedop import crd


_versions = itertools.count(100)
# Every Kubernetes API call the operator made to the emulators of this process, as RBAC sees it:
# (API group, resource[/subresource], verb). The RBAC tests compare it with the chart.
recorded: set[tuple] = set()


# Faults to inject into the operator's calls: (HTTP method, resource plural) → statuses to answer
# with, one per call, in order. The tests' own calls are never faulted.
faults: dict[tuple[str, str], list[int]] = {}
TIMEOUT = 0  # a fault that is a slow answer instead of an error status


@attrs.frozen
class InjectedFault(kmock.KubernetesError):
    status: int = 500
    reason: str = "Injected"
    message: str = "injected fault"


@attrs.frozen
class JsonPatchTestFailed(kmock.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = "the JSON patch's test operation failed: the object changed meanwhile"


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server does on every write and kmock does not: a new
    resourceVersion, a generation that moves with the spec, uid and creationTimestamp on create.
    (kopf relies on resourceVersions to tell its own writes' echoes from news.)"""

    async def _handle(self, request):
        agent = request.headers.get("User-Agent", "")
        is_object_call = request.resource is not None and request.resource.plural is not None
        if is_object_call and not agent.startswith("Python-urllib"):
            key = (request.method.value, request.resource.plural)
            if faults.get(key):
                status = faults[key].pop(0)
                if status == TIMEOUT:  # answer too late: the caller's timeout fires first
                    await asyncio.sleep(3)
                else:
                    raise InjectedFault(status=status, reason="Injected", message=f"injected {status} for {key}")
        if is_object_call and request.action is not None and not agent.startswith("Python-urllib"):
            # Not the tests' own kubectl stand-in (urllib): the operator's kopf or client calls.
            verb = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete",
                    "UPDATE": "update" if request.method == kmock.method.PUT else "patch"}[request.action.value]
            resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            recorded.add((request.resource.group or "", resource, verb))
        data = request.data
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            version = str(next(_versions))
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE:
                    meta.setdefault("uid", str(uuid.uuid4()))
                    meta.setdefault("generation", 1)
                    meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                elif "spec" in data and request.subresource is None and (current := self._current(request)) is not None:
                    if current.get("spec") != data["spec"]:
                        meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
            elif isinstance(data, list):  # a JSON patch
                current = self._current(request)
                for op in data:
                    if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and current is not None \
                            and current.get("metadata", {}).get("resourceVersion") != op.get("value"):
                        raise JsonPatchTestFailed()
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})
        return await super()._handle(request)

    def _current(self, request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None


class Emulator:
    def __init__(self):
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="kmock", daemon=True)

    def __enter__(self) -> "Emulator":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        async with VersionedEmulator() as k8s, kmock.Server(k8s) as server:
            k8s.resources.load_bundled()
            k8s.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
                kind=crd.KIND, namespaced=True, shortnames={"embsvc"},
                verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                subresources={"status", "scale"},
            )
            self.url = str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
        }))
        return path

    # -- a kubectl stand-in ---------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, content_type="application/json"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
                return json.loads(raw) if raw else {}
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def get(self, path: str):
        return self.request("GET", path)

    def merge_patch(self, path: str, body: dict):
        return self.request("PATCH", path, body, "application/merge-patch+json")


def service_path(namespace: str, name: str = "") -> str:
    return f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}" + (f"/{name}" if name else "")


def new_service(name: str, spec: dict, namespace: str = "default") -> dict:
    """A CR body as `kubectl apply` sends it."""
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec}
