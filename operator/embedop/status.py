"""The EmbeddingService's status from what the operator observed. Pure.

Two writers share the status, each with its own fields (and each writes only with the
resourceVersion it read, so neither undoes the other):
- the reconcile: observedGeneration, replicas, readyReplicas, selector, the Ready, Progressing and
  Degraded conditions, and desiredReplicas in modes off and hpa;
- the autoscaler (mode operator): desiredReplicas, the measured rates, lastScaleTime/Reason and the
  ScalingLimited and MetricsUnavailable conditions.
(spec.replicas, in modes operator and hpa, mirrors the live count: reconcile.mirror_count.)
"""

from __future__ import annotations

import datetime

RECONCILE_CONDITIONS = ("Ready", "Progressing", "Degraded")
AUTOSCALER_CONDITIONS = ("ScalingLimited", "MetricsUnavailable")
# A measurement (tokens/s, ms) is rewritten only when it has moved by more than this fraction, and by
# more than the floor: the gauges move a little at every scrape, and a status write per interval per
# service costs as many etcd writes and watch events (kopf's, kubectl's, dashboards') for nothing.
MEASURED_CHANGE, MEASURED_FLOOR = 0.02, 1.0
MEASURED_DIGITS = 3  # significant digits written


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None, previous: list[dict], now: str) -> dict:
    """A condition; lastTransitionTime moves only when the status flips."""
    status = "True" if ok else "False"
    before = next((c for c in previous or [] if c.get("type") == type_), None)
    since = before["lastTransitionTime"] if before and before.get("status") == status and before.get("lastTransitionTime") else now
    c = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def significant(x: float, digits: int = MEASURED_DIGITS) -> float:
    return float(f"{x:.{digits}g}")


def steady(previous: dict, measured: dict[str, float]) -> dict[str, float]:
    """`measured` to write: each value rounded to MEASURED_DIGITS, or the previous one kept where it
    has not moved meaningfully (so an unchanged decision writes nothing)."""
    out = {}
    for key, value in measured.items():
        before = previous.get(key)
        moved = not isinstance(before, (int, float)) or abs(value - before) > max(
            MEASURED_CHANGE * max(abs(value), abs(before)), MEASURED_FLOOR)
        out[key] = significant(value) if moved else before
    return out


def merge_conditions(previous: list[dict], ours: list[dict]) -> list[dict]:
    """`previous` with our conditions replaced where they stand (others' kept untouched, the
    order stable), new ones appended."""
    mine = {c["type"]: c for c in ours}
    out = [mine.pop(c.get("type"), c) for c in previous or []]
    return out + list(mine.values())


def from_deployment(deployment: dict | None, wanted: int | None, problems: list[str], generation: int | None,
                    previous: list[dict], now: str | None = None, rejected: str | None = None) -> dict:
    """Replica counts and Ready / Progressing / Degraded from the Deployment's status; `rejected`
    is the API's message when it refused an object the spec rendered."""
    now = now or now_iso()
    st = (deployment or {}).get("status") or {}
    replicas, ready = int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    wanted = wanted if wanted is not None else int((deployment or {}).get("spec", {}).get("replicas") or 0)
    failing = [c for c in st.get("conditions") or [] if
               (c.get("type") == "ReplicaFailure" and c.get("status") == "True")
               or (c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded")]
    if problems:
        degraded = condition("Degraded", True, "InvalidSpec", "; ".join(problems), generation, previous, now)
    elif rejected:
        degraded = condition("Degraded", True, "RejectedByAPI", rejected, generation, previous, now)
    elif deployment is None:
        degraded = condition("Degraded", True, "DeploymentMissing", "the Deployment does not exist yet", generation, previous, now)
    elif failing:
        degraded = condition("Degraded", True, failing[0].get("reason") or "DeploymentFailing",
                             failing[0].get("message", ""), generation, previous, now)
    else:
        degraded = condition("Degraded", False, "AsExpected", "", generation, previous, now)
    healthy = deployment is not None and not problems
    progressing = healthy and (updated < wanted or ready < wanted or replicas > wanted)
    is_ready = healthy and ready >= max(wanted, 1)
    return {
        "replicas": replicas,
        "readyReplicas": ready,
        "conditions": merge_conditions(previous, [
            condition("Ready", is_ready, "ReplicasReady" if is_ready else "ReplicasNotReady",
                      f"{ready}/{wanted} replicas ready", generation, previous, now),
            condition("Progressing", progressing, "RollingOut" if progressing else "Stable",
                      f"{updated} updated, {ready} ready, {replicas} existing, {wanted} wanted", generation, previous, now),
            degraded,
        ]),
    }
