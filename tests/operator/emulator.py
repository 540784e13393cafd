"""kmock's KubernetesEmulator on its own thread and loop, a kubeconfig pointing at it, and a tiny
JSON client the tests use to act as kubectl would (independent of the operator's own code)."""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import dicts as kmock_dicts

from embedop import crd
from tests.operator import structural


_versions = itertools.count(100)
# Every Kubernetes API call made to the emulators of this process by anything but the tests' own
# kubectl stand-in, as RBAC sees it: (API group, resource[/subresource], verb), per RBAC subject
# (the operator, the uninstall hook). The RBAC tests compare them with the chart.
recorded: dict[str, set[tuple]] = collections.defaultdict(set)
# Every server-side apply received, and every create (POST) made by anything but the tests' own
# kubectl stand-in (refused ones too: a 409 AlreadyExists is answered after), in order:
# {"subject", "kind", "namespace", "name", "manager", "force", "body", "create": whether a POST}.
applies: list[dict] = []
# Every DELETE received: (subject, resource plural, namespace, name, query parameters).
deletes: list[tuple] = []
# Every write refused for a stale resourceVersion: (subject, resource plural[/subresource], name).
conflicts: list[tuple] = []
# Every write (create, update, patch, delete) made by anything but the tests' own kubectl stand-in:
# (subject, resource plural[/subresource], namespace, name).
writes: list[tuple] = []


# Every call made by anything but the tests' own kubectl stand-in, in order: {"t": time.monotonic(),
# "subject", "verb" (as RBAC sees it), "resource" (plural[/subresource]), "namespace", "name", "selector"
# (the labelSelector asked for), "params" (the query), "who" (the caller's bearer token: its
# kubeconfig's user)}.
calls: list[dict] = []
# Admission policies (as Kyverno or Gatekeeper webhooks): each takes an object being created or
# changed by the operator (not through a subresource; a JSON patch's result too) and returns a
# refusal message (a webhook's 403), (status, message) (a ValidatingAdmissionPolicy's refusal is
# 422, reason Invalid, unless it says otherwise), or None.
policies: list = []
# Status fields the installed CRD's schema lacks (an older CRD than the operator): the API server
# prunes them from every write, silently, as it prunes unknown fields of a structural schema.
unknown_status: set[str] = set()
# Mutating admission webhooks: each takes an object the operator creates or changes (not through a
# subresource) and may rewrite it in place; what it leaves is what is stored and answered.
mutators: list = []
# Someone else's object created between the operator's read and its write: (resource plural,
# namespace, name) → the object, stored just before the operator's first write of that name.
races: dict[tuple[str, str, str], dict] = {}


# Faults to inject into the operator's calls: (HTTP method, resource plural, or plural/subresource
# for a subresource's calls alone[, the caller's token: its calls alone]) → statuses (or (status,
# message) pairs) to answer with, one per call, in order. The tests' own calls are never faulted.
faults: dict[tuple[str, str], list[int]] = {}
TIMEOUT = 0  # a fault that is a slow answer instead of an error status
GONE = -1  # the object is deleted (its watchers told) just before the call, which answers 404
GARBAGE = -2  # 200 with a body that is not the API's JSON (a misbehaving proxy in between)
RETRY_AFTER_S = 8  # what an injected 429 asks (longer than the operator's own back-off, 5 s)
APPLY = "application/apply-patch+yaml"
VALIDATED = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy", "Job"}


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    """An error answered as the API server's Status object."""
    return kmock.KubernetesError(status=status, reason=reason, message=message)


CONFLICT = "the object has been modified; please apply your changes to the latest version and try again"


def selector_matches(selector: str | None, labels: dict) -> bool:
    """A label selector as the API server reads it: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            ok = labels.get(k.strip()) != v.strip()
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            ok = labels.get(k.strip()) == v.strip()
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _labels(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def _drop_empty_env(obj: dict) -> None:
    """What the API server stores of a pod template: an env entry's value "" is omitted (omitempty)."""
    spec = obj.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or spec
    for container in (template.get("containers") or []) + (template.get("initContainers") or []):
        for entry in container.get("env") or []:
            if entry.get("value") == "":
                del entry["value"]


def _admit(obj: dict) -> None:
    """`policies`' verdict on an object being written (see there)."""
    for policy in policies:
        if isinstance(refusal := policy(obj), tuple):
            raise api_error(refusal[0], "Invalid" if refusal[0] == 422 else "Forbidden", refusal[1])
        if refusal:
            raise api_error(403, "Forbidden", f'admission webhook "validate.kyverno.svc" denied the request: {refusal}')


def _manager(request) -> str:
    return request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]


REQUESTS_KEPT = 8  # of kmock's own log, at most, beyond those in flight (VersionedEmulator._forget_served)


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server does and kmock does not, as far as these tests need it:

    - a record of every call (`recorded`, as RBAC sees it), write (`writes`), apply and delete;
    - on every write a new resourceVersion, a generation that moves with the spec, uid and
      creationTimestamp on create (kopf relies on resourceVersions to tell its own writes' echoes),
      a name from generateName;
    - 409 Conflict when a patch's metadata.resourceVersion (a precondition) is not the object's;
    - server-side apply: an apply creates a missing object (authorized as create); every apply is
      recorded with its field manager (`applies`);
    - of server-side apply's field ownership, only spec.replicas of Deployments: a count its only
      manager stops sending is removed and defaults to 1 (the behaviour that once collapsed fleets
      to one pod), a non-apply write that changes it takes it over, an unforced apply of another
      value conflicts with its owners; owners show in metadata.managedFields;
    - the API's validation of the built-in kinds the operator writes (kubernetes_validate,
      strict): an invalid object is refused with 422 and the validator's message;
    - admission webhooks and policies (`policies`): a refusal is a 403 with the webhook's message
      (or the status a policy gives), for writes to an object itself (as Kyverno and Gatekeeper
      see them; a JSON patch's result included), not to its scale subresource;
    - what the API server stores, not what was sent: an env entry's empty value is dropped,
      status fields an older CRD lacks (`unknown_status`) are pruned, and a custom resource served
      with its CRD's schema (InferencePools, KEDA's ScaledObjects and its HTTP add-on's routes:
      `schemas`) is pruned of what the schema lacks and defaulted (tests/operator/structural.py),
      and refused (422) where the schema or its CEL rules refuse it; mutating webhooks
      (`mutators`) rewrite objects;
    - a create (POST) of a name that exists is refused 409 AlreadyExists (kmock's), and is recorded
      in metadata.managedFields as an Update of its field manager, which a JSON patch may rewrite
      (its `test` operations are preconditions: 422 when one fails); someone else's create landing
      just before the operator's write (`races`);
    - label selectors on lists and watches (a watched object that stops matching is DELETED to
      that watch), 429 answers that carry Retry-After, and a watch ended by a 410 ERROR event
      inside its stream (`expire_watches`), as when its resourceVersion has been compacted away;
    - a watch that misses nothing created while it starts (kmock's can: `_kmock_watch`);
    - in the record of calls as RBAC sees them, the OwnerReferencesPermissionEnforcement admission
      plugin's check: a write setting blockOwnerDeletion needs update on the owner's finalizers.

    Not emulated (tests/cluster/ judges these on a real API server): ownership and removal of every
    other field (kmock merges dicts: a field dropped from an apply stays; managedFields list no
    field but spec.replicas), garbage collection through ownerReferences, foreground deletion,
    controllers, field selectors."""

    subject = "operator"

    def __init__(self, *args, subject: str = "operator", **kwargs):
        super().__init__(*args, **kwargs)
        self.subject = subject
        self.replica_owners: dict[tuple, dict[str, str]] = {}  # (ns, name) → {manager: "Apply"|"Update"}
        self.schemas: dict[str, dict] = {}  # resource plural → the openAPIV3Schema its CRD serves
        self.crds: dict[str, dict] = {}  # resource plural → the CRD installed for it
        self._in_flight: dict[int, object] = {}  # id → request, while it is served (_forget_served)

    async def _handle(self, request):
        self._in_flight[id(request)] = request
        try:
            self._forget_served()
            return await self._handle_one(request)
        finally:
            self._in_flight.pop(id(request), None)

    def _forget_served(self) -> None:
        """kmock logs every request and finds each new one in that log by a scan (each of its
        reactions asks `request in view`): over a module's thousands of calls each one grew to
        ~0.5 s, enough to lapse an operator's 3 s lease and time out its 1 s calls (a CI failure).
        The tests read their own record (`calls`), not kmock's: only the requests still being
        served (their scan is yet to come) are kept."""
        for log in (self._requests, *(getattr(p, "_requests", []) for p in self._payloads)):
            if len(log) > REQUESTS_KEPT:
                log[:] = [r for r in log if id(r) in self._in_flight]

    async def _handle_one(self, request):
        agent = request.headers.get("User-Agent", "")
        ours = not agent.startswith("Python-urllib")  # not the tests' own kubectl stand-in
        is_object_call = request.resource is not None and request.resource.plural is not None
        if is_object_call and ours:
            method, token = request.method.value, request.headers.get("Authorization", "").removeprefix("Bearer ")
            resources = ([f"{request.resource.plural}/{request.subresource}"] if request.subresource else []) + [
                request.resource.plural]  # a subresource's own faults first, each the caller's own first
            key = next((k for r in resources for k in ((method, r, token), (method, r)) if faults.get(k)), None)
            if key is not None:
                status = faults[key].pop(0)
                calls.append({"t": time.monotonic(), "subject": self.subject, "verb": "faulted",
                              "resource": request.resource.plural, "namespace": request.namespace, "name": request.name,
                              "selector": None, "who": "", "fault": status})
                if status == TIMEOUT:  # answer too late: the caller's timeout fires first
                    await asyncio.sleep(3)
                elif status == GONE:  # deleted since the caller read it, as a DELETE would
                    await self._delete_now(request)
                    raise api_error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
                elif status == GARBAGE:
                    return aiohttp.web.Response(text="<html><body>502 upstream</body></html>", content_type="text/html")
                else:  # a status, or (status, the API's message)
                    status, message = status if isinstance(status, tuple) else (status, f"injected {status} for {key}")
                    if status == 429:  # API Priority and Fairness: try again after Retry-After seconds
                        return aiohttp.web.json_response(
                            {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                             "reason": "TooManyRequests", "code": 429}, status=429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})
                    raise api_error(status, "Injected", message)
        if ours and is_object_call and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            await self._race(request)
        if ours and is_object_call and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.get("metadata") or {}
            applies.append({"subject": self.subject, "kind": request.data.get("kind"), "manager": _manager(request),
                            "namespace": request.namespace or meta.get("namespace"), "name": meta.get("name"),
                            "force": False, "body": copy.deepcopy(request.data), "create": True})
        current = self._current(request) if is_object_call and request.name else None
        is_apply = (request.method == kmock.method.PATCH and request.name is not None
                    and request.headers.get("Content-Type", "").split(";")[0] == APPLY)
        if is_apply:
            applies.append({"subject": self.subject, "kind": (request.data or {}).get("kind"),
                            "namespace": request.namespace, "name": request.name, "manager": _manager(request),
                            "force": request.params.get("force") == "true", "body": copy.deepcopy(request.data),
                            "create": False})
            if current is None and request.subresource is None:  # server-side apply creates
                request = attrs.evolve(request, action=kmock.action.CREATE)
        if is_object_call and request.action is not None and ours:
            verb = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete",
                    "UPDATE": "update" if request.method == kmock.method.PUT else "patch"}[request.action.value]
            resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            recorded[self.subject].add((request.resource.group or "", resource, verb))
            calls.append({"t": time.monotonic(), "subject": self.subject, "verb": verb, "resource": resource,
                          "namespace": request.namespace, "name": request.name,
                          "selector": request.params.get("labelSelector"),
                          "params": dict(request.params),
                          "who": request.headers.get("Authorization", "").removeprefix("Bearer ")})
            if verb not in ("list", "watch", "get"):
                writes.append((self.subject, resource, request.namespace, request.name))
            if is_apply:
                recorded[self.subject].add((request.resource.group or "", resource, "patch"))
            # The OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened
            # clusters): setting blockOwnerDeletion needs update on the owner's finalizers.
            refs = ((request.data or {}).get("metadata") or {}).get("ownerReferences") or [] \
                if isinstance(request.data, dict) and request.action in (kmock.action.CREATE, kmock.action.UPDATE) else []
            if any(r.get("blockOwnerDeletion") and r.get("apiVersion") == crd.API_VERSION for r in refs):
                recorded[self.subject].add((crd.GROUP, f"{crd.PLURAL}/finalizers", "update"))
        if request.action == kmock.action.DELETE:
            deletes.append((self.subject, request.resource.plural, request.namespace, request.name, dict(request.params)))
        data = request.data
        if isinstance(data, dict) and request.action == kmock.action.UPDATE and current is not None:
            precondition = (data.get("metadata") or {}).get("resourceVersion")
            if precondition is not None and precondition != current["metadata"].get("resourceVersion"):
                conflicts.append((self.subject, request.resource.plural + (f"/{request.subresource}" if request.subresource else ""),
                                  request.name))
                raise api_error(409, "Conflict", CONFLICT)
        if isinstance(data, dict) and request.resource is not None and request.resource.plural == "deployments" \
                and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            self._replicas(request, current, is_apply)
        if isinstance(data, dict) and request.action in (kmock.action.CREATE, kmock.action.UPDATE) \
                and not request.subresource:
            _drop_empty_env(data)
            if ours:
                for mutate in mutators:
                    mutate(data)
        if isinstance(data, dict) and request.resource is not None and request.action in (
                kmock.action.CREATE, kmock.action.UPDATE) and (schema := self.schemas.get(request.resource.plural)):
            structural.prune(data, schema)
            if request.action == kmock.action.CREATE:
                structural.default(data, schema)
        if isinstance(data, dict) and request.action == kmock.action.CREATE and not is_apply \
                and request.resource is not None and request.resource.plural != "deployments":  # (_replicas' own)
            data.setdefault("metadata", {})["managedFields"] = [
                {"manager": _manager(request), "operation": "Update", "apiVersion": data.get("apiVersion"),
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {}, "f:spec": {}},
                 "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}]
        if ours and isinstance(data, dict) and not request.subresource \
                and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            merged = data if current is None else kmock_dicts.patch_dict(current, data)
            if data.get("kind") in VALIDATED:
                self._validate(merged)
            elif data.get("kind") == "InferencePool":  # a CRD's object: its schema and CEL rules
                from tests.operator import inference_pool_schema

                crd_served = self.crds.get("inferencepools", inference_pool_schema.CRD)
                if refused := inference_pool_schema.problems({k: v for k, v in merged.items() if k != "status"}, crd_served):
                    raise api_error(422, "Invalid", f"InferencePool.{merged['metadata'].get('name')} is invalid: {refused}")
            elif request.resource is not None and request.resource.plural in KEDA_PLURALS:  # KEDA's, the add-on's
                from tests.operator import keda_schema

                if refused := keda_schema.problems(merged):
                    raise api_error(422, "Invalid", f"{merged.get('kind')}.{merged['metadata'].get('name')} is invalid: "
                                                    f"{refused}")
            _admit(merged)
        if request.subresource == "status" and isinstance(data, dict) and isinstance(data.get("status"), dict):
            data["status"] = {k: v for k, v in data["status"].items() if k not in unknown_status}
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            version = str(next(_versions))
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE:
                    if not meta.get("name") and meta.get("generateName"):  # e.g. kopf's Events
                        meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                    meta.setdefault("uid", str(uuid.uuid4()))
                    meta.setdefault("generation", 1)
                    meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                elif "spec" in data and request.subresource in (None, "scale") and current is not None:
                    if any(current.get("spec", {}).get(k) != v for k, v in data["spec"].items()):
                        meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
            elif isinstance(data, list) and current is not None:  # a JSON patch
                try:  # its test operations are preconditions
                    patched = jsonpatch.apply_patch(copy.deepcopy(current or {}), data)
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                    raise api_error(422, "Invalid", f"the JSON patch failed: {e}") from None
                if ours and not request.subresource:  # admission judges the patched object
                    _admit(patched)
                if request.resource.plural == "deployments":  # ownership rewritten
                    self.replica_owners[(request.namespace, request.name)] = {
                        m["manager"]: m["operation"] + (f"/{m['subresource']}" if m.get("subresource") else "")
                        for m in (patched.get("metadata") or {}).get("managedFields") or []
                        if "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})}
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})
        if is_apply and request.action == kmock.action.CREATE:
            return await self._create(request)  # kmock's own create answers POSTs only
        if request.action == kmock.action.CREATE and request.resource is not None and not self._served(request.resource):
            raise api_error(404, "NotFound", "the server could not find the requested resource")  # kmock stores it
        return await super()._handle(request)

    async def _delete_now(self, request) -> None:
        """The object `request` names goes, and its watchers see it go (as kmock's own DELETE)."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key in self._objects and not self._objects[key].deleted:
                self._objects[key].delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": self._objects[key].last.raw})

    def _served(self, res) -> bool:
        """Whether the API serves `res` (a kind whose CRD is not installed: not)."""
        return f"{res.group}/{res.version}/{res.plural}" in self.resources or f"{res.version}/{res.plural}" in self.resources

    async def _race(self, request) -> None:
        """Someone else's object of `races`, stored (once) just before this write of its name."""
        res = request.resource
        meta = ((request.data if isinstance(request.data, dict) else {}).get("metadata")) or {}
        name, namespace = request.name or meta.get("name"), request.namespace or meta.get("namespace")
        body = races.pop((res.plural, namespace, name), None)
        if body is None:
            return
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        meta.update(name=name, namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=str(next(_versions)))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        key = (res, namespace, name)
        async with self._lock:
            if key in self._objects:
                self._objects[key].create(body)
            else:
                self._objects[key] = body
            await self._buses[res].put({"type": "ADDED", "object": self._objects[key].raw})

    async def _create(self, request) -> aiohttp.web.StreamResponse:
        """What kmock does for a POST, for a server-side apply that creates."""
        res = request.resource
        if not self._served(res):
            # A kind whose CRD is not installed: the real API server has no such path (kmock's own
            # create answers a POST so; an apply reaches here).
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key in self._objects:  # deleted earlier
                self._objects[key].create(request.data)
            else:
                self._objects[key] = request.data
            raw = self._objects[key].raw
            await self._buses[request.resource].put({"type": "ADDED", "object": raw})
        return aiohttp.web.json_response(raw, status=201)

    def _replicas(self, request, current: dict | None, is_apply: bool) -> None:
        """spec.replicas under server-side apply's ownership rules (see the class docstring)."""
        data = request.data
        key = (request.namespace or data["metadata"].get("namespace"), request.name or data["metadata"]["name"])
        owners = {} if current is None else self.replica_owners.get(key, {})
        manager = _manager(request)
        spec = data.get("spec") or {}
        before = (current or {}).get("spec", {}).get("replicas")
        if request.subresource == "scale" or not is_apply:  # an update: takes what it changes
            if "replicas" in spec and spec["replicas"] != before:  # (through the scale subresource: its entry says so)
                owners = {manager: "Update/scale" if request.subresource == "scale" else "Update"}
        elif "replicas" in spec:
            others = {m for m in owners if m != manager}
            if spec["replicas"] != before and others and request.params.get("force") != "true":
                raise api_error(409, "Conflict", f"Apply failed with 1 conflict: conflict with {sorted(others)}: .spec.replicas")
            owners = {manager: "Apply"} if spec["replicas"] != before else {**owners, manager: "Apply"}
        elif manager in owners:
            owners = {m: op for m, op in owners.items() if m != manager}
            if not owners:  # its only manager dropped it: removed, and the Deployment defaults it
                data.setdefault("spec", {})["replicas"] = 1
        if current is None and "replicas" not in spec:
            data.setdefault("spec", {})["replicas"] = 1  # defaulted: no owner
        self.replica_owners[key] = owners
        if request.subresource is None:
            data.setdefault("metadata", {})["managedFields"] = [
                {"manager": m, "operation": op.split("/")[0], "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:spec": {"f:replicas": {}}}, **({"subresource": "scale"} if op.endswith("/scale") else {})}
                for m, op in owners.items()]

    async def _serve_list(self, request):
        out = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        return {**out, "items": [o for o in out["items"] if selector_matches(selector, _labels(o))]}

    async def _kmock_watch(self, request):
        """kmock's watch, with its bus marked in the same lock as the snapshot of existing objects.
        kmock marks the bus only after it has streamed that snapshot, so an object created
        meanwhile was in neither: lost to the watch for good (an operator that never made one
        service's Deployment, in CI). A real API server never loses it: a watch resumes from the
        list's resourceVersion."""
        yield b""  # the headers go out now, as kmock's: a quiet watch is still a stream
        check = self._KubernetesEmulator__check  # kmock's own matching (name-mangled private)
        bus = self._buses[request.resource]
        async with self._lock:  # every put to a bus happens under this lock
            marker = await bus.mark()
            existing = [o.raw for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]
        try:
            for raw in existing:
                yield {"type": "ADDED", "object": raw}
            async for event in bus.stream(since=marker):
                meta = (event.get("object") or {}).get("metadata") or {}
                if check(request, request.resource, meta.get("namespace"), meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(marker)

    async def _serve_watch(self, request):
        selector, sent = request.params.get("labelSelector"), set()
        async for event in self._kmock_watch(request):
            if isinstance(event, dict) and event.get("type") == "ERROR":
                yield event  # what a real API server does next: end the stream
                return
            if not selector or not isinstance(event, dict):
                yield event
                continue
            meta = event["object"].get("metadata") or {}
            key = (meta.get("namespace"), meta.get("name"))
            if selector_matches(selector, _labels(event["object"])):
                (sent.discard if event["type"] == "DELETED" else sent.add)(key)
                yield event
            elif key in sent:  # it no longer matches: gone, as far as this watch can tell
                sent.discard(key)
                yield {"type": "DELETED", "object": event["object"]}

    @staticmethod
    def _validate(obj: dict) -> None:
        import kubernetes_validate

        obj = {k: v for k, v in obj.items() if k != "status"}
        try:
            kubernetes_validate.validate(obj, "1.31.0", strict=True)
        except kubernetes_validate.ValidationError as e:
            raise api_error(422, "Invalid", f"{obj.get('kind')}.{obj['metadata'].get('name')} is invalid: {e}") from None

    def _current(self, request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None


def _serve_inference_pools(k8s, crd_file: Path | None = None) -> None:
    """The InferencePool CRD of `crd_file` (a vendored fixture; by default the newest tracked)
    installed: its objects pruned and defaulted by its v1 schema, validated by it."""
    from tests.operator import inference_pool_schema

    served = yaml.safe_load(crd_file.read_text()) if crd_file else inference_pool_schema.CRD
    k8s.crds["inferencepools"] = served
    k8s.schemas["inferencepools"] = inference_pool_schema.v1_schema(served)
    k8s.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, shortnames={"infpool"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status"})


# KEDA's ScaledObjects and its HTTP add-on's InterceptorRoutes and HTTPScaledObjects (their CRDs:
# tests/operator/fixtures, keda_schema.py).
KEDA_PLURALS = ("scaledobjects", "interceptorroutes", "httpscaledobjects")


def _serve_keda(k8s, plurals) -> None:
    """The CRDs of `plurals` (KEDA_PLURALS) installed: their objects pruned and defaulted by their
    served version's schema, validated by it and its CEL rules (keda_schema.problems)."""
    from tests.operator import keda_schema

    for plural in plurals:
        crd_ = keda_schema.CRDS[plural]
        group, version = crd_["spec"]["group"], keda_schema.served(crd_)["name"]
        k8s.crds[plural], k8s.schemas[plural] = crd_, keda_schema.schema(plural)
        k8s.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
            kind=keda_schema.kind(plural), namespaced=True, shortnames=set(crd_["spec"]["names"].get("shortNames") or []),
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status"})


class Emulator:
    def __init__(self, subject: str = "operator", with_crd: bool = True, inference_pools: bool | Path = False,
                 keda: bool | tuple[str, ...] = False):
        """with_crd=False: the EmbeddingService resource is unknown to the API (no CRD).
        inference_pools: the Gateway API Inference Extension's InferencePool CRD is installed (by
        default not, as in most clusters: its list and writes are 404, as a real API server's);
        a path: that CRD file (tests/operator/fixtures), else the newest one tracked.
        keda: KEDA's and its HTTP add-on's CRDs installed (True: all three; or those of these
        plurals, KEDA_PLURALS); by default none, as in a cluster without KEDA."""
        self.subject, self.with_crd, self.inference_pools = subject, with_crd, inference_pools
        self.keda = KEDA_PLURALS if keda is True else tuple(keda or ())
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
        async with VersionedEmulator(subject=self.subject) as k8s, kmock.Server(k8s) as server:
            k8s.resources.load_bundled()
            if self.with_crd:
                k8s.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
                    kind=crd.KIND, namespaced=True, shortnames={"embsvc"},
                    verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                    subresources={"status", "scale"},
                )
            if self.inference_pools:
                _serve_inference_pools(k8s, self.inference_pools if isinstance(self.inference_pools, Path) else None)
            _serve_keda(k8s, self.keda)
            self.k8s = k8s
            self.url = str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def install_inference_pools(self) -> None:
        """The InferencePool CRD installed now, while the operator runs."""
        async def install():
            _serve_inference_pools(self.k8s)
        asyncio.run_coroutine_threadsafe(install(), self._loop).result(5)

    def install_keda(self, plurals=KEDA_PLURALS) -> None:
        """KEDA's (and its add-on's) CRDs of `plurals` installed now, while the operator runs."""
        async def install():
            _serve_keda(self.k8s, plurals)
        asyncio.run_coroutine_threadsafe(install(), self._loop).result(5)

    def expire_watches(self, plural: str) -> None:
        """End every watch of `plural` as a real API server does when the version a watch resumes
        from has been compacted away: an ERROR event (HTTP 200, in the stream) with a 410 Status."""
        resource = next(r for r in self.k8s._buses if r.plural == plural)
        error = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                             "reason": "Expired", "message": "too old resource version: 1 (999)"}}
        asyncio.run_coroutine_threadsafe(self.k8s._buses[resource].put(error), self._loop).result(5)

    def kubeconfig(self, path: Path, token: str = "kmock") -> Path:
        """`token`: who the calls made with it come from (calls[...]["who"])."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": token}}],
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
