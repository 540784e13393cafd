"""An EmbeddingService spec, defaulted from the CRD schema and checked for what the schema
cannot say. Pure."""

from __future__ import annotations

import msgspec
from lightkube.models import core_v1, networking_v1

from embedop import crd, render, render_cache, render_gateway, render_keda, render_models, render_security

# Spec fields of Kubernetes types the CRD leaves open (by path), and the model each must fit.
KUBERNETES_TYPES = {
    "affinity": core_v1.Affinity,
    "topologySpreadConstraints": list[core_v1.TopologySpreadConstraint],
    "envFrom": list[core_v1.EnvFromSource],
    "env": list[core_v1.EnvVar],
    "networkPolicy.from": list[networking_v1.NetworkPolicyPeer],
    "networkPolicy.metricsFrom": list[networking_v1.NetworkPolicyPeer],
}


def _at(spec: dict, path: str):
    """The value at a dotted path, or None where any part is missing."""
    for part in path.split("."):
        if not isinstance(spec, dict) or part not in spec:
            return None
        spec = spec[part]
    return spec


def defaulted(spec: dict) -> dict:
    """The spec as the API server stores it: schema defaults applied."""
    return crd.with_defaults(spec or {}, crd.SPEC)


def _unknown(given, known, path: str) -> list[str]:
    """Paths present in `given` that the model dropped (unknown fields, so likely typos)."""
    if isinstance(given, dict):
        known = known if isinstance(known, dict) else {}
        return [p for k, v in given.items()
                for p in ([f"{path}.{k}"] if k not in known else _unknown(v, known[k], f"{path}.{k}"))]
    if isinstance(given, list) and isinstance(known, list):
        return [p for i, (g, k) in enumerate(zip(given, known)) for p in _unknown(g, k, f"{path}[{i}]")]
    return []


def kubernetes_problems(spec: dict) -> list[str]:
    """The open Kubernetes-typed fields checked against lightkube's models of the Kubernetes API:
    wrong types and unknown (misspelt) fields, which the API server would drop without a word."""
    out = []
    for field, model in KUBERNETES_TYPES.items():
        if (given := _at(spec, field)) is None:
            continue
        try:
            known = msgspec.to_builtins(msgspec.convert(given, model))
        except msgspec.ValidationError as e:
            out.append(f"{field}: {e}")
            continue
        out += [f"{path}: unknown field" for path in _unknown(given, known, field)]
    return out


def _zero(v) -> bool:
    return str(v) in ("0", "0%")


def task(spec: dict) -> str | None:
    """The task the pods are told to serve: spec.task, else a TASK in spec.env (how it was set
    before spec.task existed), else None (the server infers it)."""
    if spec.get("task"):
        return spec["task"]
    return next((e.get("value") for e in spec.get("env", []) if e["name"] == "TASK" and e.get("value")), None)


def problems(spec: dict, name: str | None = None) -> list[str]:
    """Reasons a schema-valid spec (of the service `name`) still cannot work (the CRD's CEL rules
    are repeated here, so a server without them, or an emulator, gets the same answer). Empty when
    it can."""
    out = []
    if name is not None and len(name) > crd.MAX_NAME:
        out.append(f"metadata.name: {crd.NAME_RULE}")
    b, a, p, s = spec["batching"], spec["admission"], spec["pooling"], spec["autoscaling"]
    buckets = b["buckets"]
    if buckets != sorted(set(buckets)):
        out.append(f"batching.buckets must be ascending and distinct, got {buckets}")
    if b["maxTokensPerBatch"] < max(buckets):
        out.append(f"batching.maxTokensPerBatch ({b['maxTokensPerBatch']}) is below the largest bucket ({max(buckets)}): no row of that bucket could run")
    if a["latencySoftMs"] > a["latencyHardMs"]:
        out.append("admission.latencySoftMs must not exceed latencyHardMs")
    mean_modes = ("mean", "weightedmean", "mean_sqrt_len_tokens")
    if p.get("excludeTokens") and p.get("strategy") and not any(m in mean_modes for m in p["strategy"].split("+")):
        out.append(f"pooling.excludeTokens applies to mean pooling only, not {p['strategy']}")
    if s["minReplicas"] > s["maxReplicas"]:
        out.append(f"autoscaling.minReplicas ({s['minReplicas']}) exceeds maxReplicas ({s['maxReplicas']})")
    if s["mode"] not in ("off", "keda") and s["minReplicas"] < 1:
        out.append(f"autoscaling.{crd.MIN_REPLICAS_RULE}")
    if _zero(spec["rollout"]["maxSurge"]) and _zero(spec["rollout"]["maxUnavailable"]):
        out.append("rollout.maxSurge and maxUnavailable cannot both be 0: the rollout could never progress")
    if any("value" in e and "valueFrom" in e for e in spec.get("env", [])):
        out.append("env: value and valueFrom are exclusive")
    if reserved := sorted({e["name"] for e in spec.get("env", [])} & set(render.RESERVED_ENV)):
        out.append(f"env: {', '.join(reserved)}: {crd.RESERVED_ENV_RULE}")
    if spec.get("task") and any(e["name"] == "TASK" for e in spec.get("env", [])):
        # An env entry would override the rendered TASK, and status would compare the pods with
        # a task they were never given.
        out.append("env: TASK and spec.task both set: remove TASK from env (spec.task renders it)")
    if clash := sorted({e["name"] for e in spec.get("env", [])} & render_security.settings_owned(spec)):
        # Ours would be overridden: a server pointed at files that are not mounted.
        out.append(f"env: {', '.join(clash)}: set from spec.auth / spec.tls; remove it from env")
    for field in ("from", "metricsFrom"):
        for i, peer in enumerate((spec.get("networkPolicy") or {}).get(field) or []):
            if isinstance(peer, dict) and ("ipBlock" in peer) == bool({"podSelector", "namespaceSelector"} & peer.keys()):
                out.append(f"networkPolicy.{field}[{i}]: a peer is an ipBlock, or a podSelector and/or a "
                           "namespaceSelector: one of the two, not both, not neither")
    if spec["resources"]["gpu"] > 1:
        out.append(f"resources.gpu: {crd.GPU_RULE}")
    if "image" in spec and not spec["image"].strip():
        out.append("image is empty")
    return out + render_models.problems(spec) + render_cache.problems(spec) + kubernetes_problems(spec)


def warnings(spec: dict) -> list[str]:
    """What a spec that works may still get wrong, said (an Event) but never refused: the spec is
    valid, and which peers are Prometheus no schema can tell."""
    out = []
    policy = spec.get("networkPolicy") or {}
    if spec["autoscaling"]["mode"] == "hpa" and policy.get("enabled") and not policy.get("metricsFrom"):
        # The operator's own pods are admitted to the metrics port, but in mode hpa nothing of the
        # operator reads it: the HPA's metric comes from Prometheus, through prometheus-adapter.
        out.append("networkPolicy: autoscaling.mode hpa reads the pods' metrics through Prometheus, and "
                   "networkPolicy.metricsFrom is empty: the policy keeps Prometheus from the metrics port, and the "
                   "HorizontalPodAutoscaler gets no metrics (it holds the count); add Prometheus's pods to metricsFrom")
    elif policy.get("enabled") and not policy.get("metricsFrom"):
        # Modes operator and off: the operator's own pods are admitted (its scrapes work), but
        # nothing else is: Prometheus (the chart's ServiceMonitor, dashboards, alerts, KEDA's
        # prometheus trigger) reads nothing, and the operator's status and scaling look fine.
        out.append("networkPolicy: networkPolicy.metricsFrom is empty: only this operator reaches the pods' metrics "
                   "port, and Prometheus (a ServiceMonitor, dashboards, alerts, KEDA) scrapes nothing; add "
                   "Prometheus's pods to metricsFrom (if nothing else scrapes this service, ignore this)")
    if spec.get("routing") == "gateway":
        out += render_gateway.warnings(spec)
    return out + render_keda.warnings(spec)
