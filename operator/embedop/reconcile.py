"""One reconcile of an EmbeddingService: render what it owns, apply what drifted, report status.
Plain functions over a Kube client; the kopf handlers call them."""

from __future__ import annotations

import dataclasses
import logging

from embedop import render, spec as specs, status
from embedop.config import OperatorSettings
from embedop.kube import Kube

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Outcome:
    problems: list[str]
    applied: list[str]  # "Kind/name" of objects created or changed


def subset(desired, actual) -> bool:
    """Whether every field we set has our value (the server may add defaults of its own)."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and subset(v, actual[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(desired) == len(actual) and all(map(subset, desired, actual))
    return desired == actual or (desired is not None and str(desired) == str(actual))


def owner_of(body: dict) -> render.Owner:
    meta = body["metadata"]
    return render.Owner(meta["name"], meta["namespace"], meta.get("uid", ""))


def reconcile(kube: Kube, settings: OperatorSettings, body: dict) -> Outcome:
    """Bring the owned objects to the spec (only those that differ are written) and the status
    to what is observed. An unworkable spec writes nothing but a Degraded status."""
    spec = specs.defaulted(body.get("spec") or {})
    problems = specs.problems(spec)
    owner = owner_of(body)
    applied = []
    if not problems:
        desired_replicas = (body.get("status") or {}).get("desiredReplicas")
        image = spec.get("image") or settings.server_image
        for obj in render.owned(owner, spec, image, desired_replicas, settings.grace_seconds, settings.metrics_port):
            current = kube.get(obj["kind"], owner.namespace, obj["metadata"]["name"])
            if obj["kind"] == "Deployment" and current is not None and spec["autoscaling"]["mode"] == "operator":
                obj["spec"].pop("replicas", None)  # the autoscaler owns the count once it exists
            if current is None or not subset(obj, current):
                kube.apply(obj)
                applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        if spec["autoscaling"]["mode"] != "hpa":
            hpa = kube.get("HorizontalPodAutoscaler", owner.namespace, owner.name)
            if hpa is not None and _owned_by(hpa, owner):
                kube.delete("HorizontalPodAutoscaler", owner.namespace, owner.name)
                applied.append(f"-HorizontalPodAutoscaler/{owner.name}")
    sync_status(kube, body, spec, problems)
    return Outcome(problems, applied)


def sync_status(kube: Kube, body: dict, spec: dict, problems: list[str]) -> None:
    owner = owner_of(body)
    deployment = kube.get("Deployment", owner.namespace, owner.name)
    previous = body.get("status") or {}
    wanted = render.deployment_replicas(spec, previous.get("desiredReplicas"))
    new = status.from_deployment(deployment, wanted, problems, body["metadata"].get("generation"),
                                 previous.get("conditions", []))
    new["selector"] = render.selector_string(owner.name)
    if wanted is not None:
        new.setdefault("desiredReplicas", previous.get("desiredReplicas", wanted))
    if body["metadata"].get("generation") is not None:
        new["observedGeneration"] = body["metadata"]["generation"]
    if not subset(new, previous):
        kube.patch_status(owner.namespace, owner.name, new)


def _owned_by(obj: dict, owner: render.Owner) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences", [])
    return any(r.get("kind") == "EmbeddingService" and r.get("name") == owner.name for r in refs)
