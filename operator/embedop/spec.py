"""An EmbeddingService spec, defaulted from the CRD schema and checked for what the schema
cannot say. Pure."""

from __future__ import annotations

from embedop import crd


def defaulted(spec: dict) -> dict:
    """The spec as the API server stores it: schema defaults applied."""
    return crd.with_defaults(spec or {}, crd.SPEC)


def problems(spec: dict) -> list[str]:
    """Reasons a schema-valid spec still cannot work (the CRD's CEL rules are repeated here, so
    a server without them, or an emulator, gets the same answer). Empty when it can."""
    out = []
    b, a, p, s = spec["batching"], spec["admission"], spec["pooling"], spec["autoscaling"]
    buckets = b["buckets"]
    if buckets != sorted(set(buckets)):
        out.append(f"batching.buckets must be ascending and distinct, got {buckets}")
    if b["maxTokensPerBatch"] < max(buckets):
        out.append(f"batching.maxTokensPerBatch ({b['maxTokensPerBatch']}) is below the largest bucket ({max(buckets)}): no row of that bucket could run")
    if a["latencySoftMs"] > a["latencyHardMs"]:
        out.append("admission.latencySoftMs must not exceed latencyHardMs")
    if p.get("excludeTokens") and p["strategy"] != "mean":
        out.append(f"pooling.excludeTokens applies to mean pooling only, not {p['strategy']}")
    if s["minReplicas"] > s["maxReplicas"]:
        out.append(f"autoscaling.minReplicas ({s['minReplicas']}) exceeds maxReplicas ({s['maxReplicas']})")
    if "image" in spec and not spec["image"].strip():
        out.append("image is empty")
    return out
