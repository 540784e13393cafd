"""One reconcile of an EmbeddingService: render what it owns, apply what drifted, report status.
Plain async functions over a Kube client; the kopf handlers and the service loops call them.

Every write is computed from fresh reads and guarded by their resourceVersion. The Deployment is
read first and the service after it, so whatever an apply carries comes from a spec at least as new
as the one behind the Deployment it replaces: the autoscaler (which applies the same render with
its count) and the reconcile cannot undo each other, and a stale count or spec fails with Conflict
and is recomputed. (Kubernetes' documentation advises controllers against a resourceVersion in an
apply because the object's status moves it often; only the Deployment's apply carries one, for the
count's sake, and a conflict costs a re-read.)"""

from __future__ import annotations

import asyncio
import dataclasses
import decimal
from typing import Awaitable, Callable

from lightkube.utils.quantity import parse_quantity

from embedop import crd, render, spec as specs, status
from embedop.config import OperatorSettings
from embedop.kube import FIELD_MANAGER, HANDOVER_MANAGER, Conflict, Kube, NotFound, Rejected, Retryable

CONFLICT_RETRIES = 5
LEGACY_FINALIZER = f"{crd.GROUP}/finalizer"


@dataclasses.dataclass
class Outcome:
    problems: list[str]
    applied: list[str]  # "Kind/name" of objects created or changed
    rejected: str | None = None  # the API's message when it refused an object
    notice: str | None = None  # e.g. a newer default image that this service does not get
    gone: bool = False  # the service no longer exists or is being deleted
    body: dict | None = None  # the service as read


# The fields we write that the API server stores as resource.Quantity, rewritten in its canonical
# form ("2.5" → "2500m", "1024Mi" → "1Gi", "1000m" → "1"): compared as quantities. Everything else
# is compared exactly (an env value "1k" is not "1000", false is not 0). Suffixes of the path of
# dict keys (list positions left out); "*" is any key.
QUANTITY_PATHS = (("resources", "requests", "*"), ("resources", "limits", "*"), ("emptyDir", "sizeLimit"),
                  ("target", "averageValue"), ("target", "value"))


def _is_quantity(path: tuple[str, ...]) -> bool:
    return any(len(path) >= len(q) and all(k in ("*", p) for k, p in zip(q, path[-len(q):])) for q in QUANTITY_PATHS)


def _same_scalar(a, b, path: tuple[str, ...] = ()) -> bool:
    if not _is_quantity(path):
        return a == b and isinstance(a, bool) == isinstance(b, bool)
    if str(a) == str(b):
        return True
    try:
        qa, qb = parse_quantity(str(a)), parse_quantity(str(b))
    except (ValueError, decimal.InvalidOperation):
        return False
    return qa is not None and qa == qb


def subset(desired, actual, path: tuple[str, ...] = ()) -> bool:
    """Whether every field we set has our value (the server may add defaults of its own, and
    writes quantities in its canonical form). `path`: where `desired` sits in its object."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and subset(v, actual[k], (*path, k))
                                                for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(desired) == len(actual)
                and all(subset(d, a, path) for d, a in zip(desired, actual)))
    return _same_scalar(desired, actual, path)


def owner_of(body: dict) -> render.Owner:
    meta = body["metadata"]
    return render.Owner(meta["name"], meta["namespace"], meta.get("uid", ""))


def _alive(body: dict | None) -> bool:
    return body is not None and not body["metadata"].get("deletionTimestamp")


def owns_replicas(deployment: dict, manager: str = FIELD_MANAGER) -> bool:
    """Whether `manager` holds spec.replicas by apply (from the Deployment's managedFields)."""
    return any(m.get("manager") == manager and m.get("operation") == "Apply"
               and "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
               for m in (deployment.get("metadata") or {}).get("managedFields") or [])


async def hand_over_replicas(kube: Kube, live: dict) -> dict:
    """Before our first apply without spec.replicas (mode hpa): a one-off apply of only the live
    count under a second manager, so the field keeps an owner and its value until the
    HorizontalPodAutoscaler writes it (it then owns it alone). A conflict means the HPA already
    owns the count: nothing to hand over. → the Deployment as it is now."""
    meta = live["metadata"]
    body = {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": live["spec"]["replicas"]}}
    try:
        return await kube.apply(body, manager=HANDOVER_MANAGER, force=False)
    except Conflict:
        return live


def deployment_for(settings: OperatorSettings, body: dict, spec: dict, live: dict | None,
                   decision: int | None = None) -> tuple[dict, str | None]:
    """The Deployment as it must be applied now: the spec's render, the count as
    render.deployment_replicas says (from the live Deployment, or the autoscaler's `decision`),
    guarded by the live resourceVersion. → (body, image notice)."""
    live_count = live["spec"].get("replicas") if live else (body.get("status") or {}).get("desiredReplicas")
    image, notice = render.server_image(spec, live, settings.server_image)
    replicas = render.deployment_replicas(spec, live_count, decision, exists=live is not None)
    obj = render.deployment(owner_of(body), spec, image, replicas, settings.grace_seconds, settings.metrics_port)
    if live is not None:
        obj["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    return obj, notice


async def mirror_count(kube: Kube, body: dict, count: int) -> bool:
    """spec.replicas := `count` (the live Deployment's, render.mirrored_replicas) through the
    service's scale subresource, guarded by the resourceVersion of `body`. On a conflict the
    Deployment and the service are read again, and the live count is written unless spec.replicas
    itself has changed since `body` (a patch that sets mode off and replicas together keeps its
    replicas; one that only switches the mode still gets the fleet's count). The write changes the
    service's spec, so it comes back as an update: that reconcile finds the count in place and
    writes nothing more. → whether it was written."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    seen = (body.get("spec") or {}).get("replicas")
    for _ in range(CONFLICT_RETRIES):
        try:
            await kube.patch_scale(namespace, name, count, body["metadata"]["resourceVersion"])
            return True
        except NotFound:
            return False
        except Conflict:
            live = await kube.get("Deployment", namespace, name)
            body = await kube.get(crd.KIND, namespace, name)
            if not _alive(body) or live is None or (body.get("spec") or {}).get("replicas") != seen:
                return False
            count = live["spec"].get("replicas")
            if count is None or count == seen:
                return False
    raise Retryable(f"spec.replicas of {namespace}/{name}: still conflicting after {CONFLICT_RETRIES} attempts")


async def retry_conflicts(attempt: Callable[[], Awaitable]):
    """Run `attempt` (which reads fresh and writes guarded) again while it meets a Conflict."""
    for i in range(CONFLICT_RETRIES):
        try:
            return await attempt()
        except Conflict:
            await asyncio.sleep(0.05 * (i + 1))
    raise Retryable(f"still conflicting after {CONFLICT_RETRIES} attempts")


async def reconcile(kube: Kube, settings: OperatorSettings, namespace: str, name: str) -> Outcome:
    """Bring the owned objects to the spec (only those that differ are written) and the status
    to what is observed. An unworkable spec writes nothing but a Degraded status."""
    return await retry_conflicts(lambda: _reconcile_once(kube, settings, namespace, name))


async def _reconcile_once(kube: Kube, settings: OperatorSettings, namespace: str, name: str) -> Outcome:
    live = await kube.get("Deployment", namespace, name)  # first: see the module's docstring
    body = await kube.get(crd.KIND, namespace, name)
    if body is not None and LEGACY_FINALIZER in (body["metadata"].get("finalizers") or []):
        # Left by an operator before 0.1.1 (or one that died holding it): it would keep a deleted
        # service in Terminating, and its namespace with it, for as long as no operator runs.
        kept = [f for f in body["metadata"]["finalizers"] if f != LEGACY_FINALIZER]
        await kube.set_finalizers(namespace, name, kept, body["metadata"]["resourceVersion"])
        body = await kube.get(crd.KIND, namespace, name)
    if not _alive(body):  # deleted: the garbage collector removes what it owned
        return Outcome([], [], gone=True, body=body)
    spec = specs.defaulted(body.get("spec") or {})
    problems = specs.problems(spec)
    outcome = Outcome(problems, [], body=body)
    hpa = None
    if not problems:
        try:
            hpa = await _apply_owned(kube, settings, body, spec, live, outcome)
        except Rejected as e:
            outcome.rejected = str(e)
        live = await kube.get("Deployment", namespace, name) if outcome.applied else live
    # Whatever the spec's problems: the fleet runs at this count, and a switch to off must keep it.
    count = render.mirrored_replicas(spec, live["spec"].get("replicas") if live else None)
    if count is not None:
        try:
            if await mirror_count(kube, body, count):
                outcome.applied.append(f"{crd.KIND}/{name} spec.replicas={count}")
        except Rejected as e:
            outcome.rejected = outcome.rejected or str(e)
        body = await kube.get(crd.KIND, namespace, name)  # its generation has moved
        if not _alive(body):
            return dataclasses.replace(outcome, gone=True, body=body)
        outcome.body = body
    await _write_status(kube, body, spec, live, hpa, outcome)
    return outcome


async def _apply_owned(kube: Kube, settings: OperatorSettings, body: dict, spec: dict, live: dict | None,
                       outcome: Outcome) -> dict | None:
    """→ the live HorizontalPodAutoscaler (mode hpa), for status."""
    owner = owner_of(body)
    deployment, outcome.notice = deployment_for(settings, body, spec, live)
    # Whether we own the count must match whether we send it: after a mode switch, an apply takes
    # it (from the HPA's controller, kubectl scale) or, in mode hpa, releases it after the handover.
    ownership_differs = live is not None and ("replicas" in deployment["spec"]) != owns_replicas(live)
    if ownership_differs and "replicas" not in deployment["spec"] and not owns_replicas(live, HANDOVER_MANAGER):
        live = await hand_over_replicas(kube, live)
        deployment["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    if live is None or ownership_differs or not subset(_unguarded(deployment), live):
        await kube.apply(deployment)
        outcome.applied.append(f"Deployment/{owner.name}")
    hpa = None
    for obj in render.companions(owner, spec, settings.metrics_port):
        current = await kube.get(obj["kind"], owner.namespace, obj["metadata"]["name"])
        if current is None or not subset(obj, current):
            current = await kube.apply(obj)
            outcome.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        if obj["kind"] == "HorizontalPodAutoscaler":
            hpa = current
    if spec["autoscaling"]["mode"] != "hpa":
        existing = await kube.get("HorizontalPodAutoscaler", owner.namespace, owner.name)
        if existing is not None and _owned_by(existing, owner):
            await kube.delete("HorizontalPodAutoscaler", owner.namespace, owner.name)
            outcome.applied.append(f"-HorizontalPodAutoscaler/{owner.name}")
    return hpa


def _unguarded(obj: dict) -> dict:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


def desired_replicas(spec: dict, deployment: dict | None, hpa: dict | None) -> int | None:
    """status.desiredReplicas as the reconcile writes it: spec.replicas (off), the HPA's wish or
    the Deployment's count (hpa); None in mode operator, where the autoscaler writes it."""
    mode = spec["autoscaling"]["mode"]
    if mode == "off":
        return spec["replicas"]
    if mode == "hpa":
        wish = ((hpa or {}).get("status") or {}).get("desiredReplicas")
        return wish if wish is not None else ((deployment or {}).get("spec") or {}).get("replicas")
    return None


async def _write_status(kube: Kube, body: dict, spec: dict, deployment: dict | None, hpa: dict | None,
                        outcome: Outcome) -> None:
    owner = owner_of(body)

    def compute(fresh: dict) -> dict:
        previous = fresh.get("status") or {}
        generation = fresh["metadata"].get("generation")
        wanted = (spec["replicas"] if spec["autoscaling"]["mode"] == "off"
                  else ((deployment or {}).get("spec") or {}).get("replicas"))
        new = status.from_deployment(deployment, wanted, outcome.problems, generation,
                                     previous.get("conditions") or [], rejected=outcome.rejected)
        new["selector"] = render.selector_string(owner.name)
        if (desired := desired_replicas(spec, deployment, hpa)) is not None:
            new["desiredReplicas"] = desired
        if generation is not None:
            new["observedGeneration"] = generation
        return new

    await update_status(kube, owner.namespace, owner.name, compute, body)


async def update_status(kube: Kube, namespace: str, name: str, compute: Callable[[dict], dict],
                        body: dict | None = None) -> None:
    """Write `compute(service)` to its status when it differs, guarded by the resourceVersion
    it was computed from; on Conflict the service is read again and the status recomputed.
    `body`: a fresh read to start from."""
    pending = [body]

    async def attempt():
        fresh = (pending.pop() if pending else None) or await kube.get(crd.KIND, namespace, name)
        if _alive(fresh) and not subset(new := compute(fresh), fresh.get("status") or {}):
            try:
                await kube.patch_status(namespace, name, new, fresh["metadata"]["resourceVersion"])
            except NotFound:  # deleted since it was read: nothing left to report on
                pass

    await retry_conflicts(attempt)


def _owned_by(obj: dict, owner: render.Owner) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences", [])
    return any(r.get("kind") == "EmbeddingService" and r.get("name") == owner.name for r in refs)
