"""The EmbeddingService's status from what the operator observed. Pure.

Two writers share the status, each with its own fields (and each writes only with the
resourceVersion it read, so neither undoes the other):
- the reconcile: observedGeneration, replicas, readyReplicas, selector, defaultImage, the Ready,
  Progressing, Degraded, FieldNotPersisted and ModelCacheShared conditions, and desiredReplicas in modes off, hpa and
  keda (the HorizontalPodAutoscaler's wish, ours or KEDA's; in off and hpa it clears the
  autoscaler's conditions and measurements, which would go stale);
- the autoscaler (modes operator and keda, AUTOSCALER_MODES: it scrapes the pods): desiredReplicas
  (mode operator), the measured rates, lastScaleTime/Reason, the served task, with spec.models each
  model's (status.models), and the ScalingLimited, MetricsUnavailable and TaskMismatch conditions
  (the reconcile clears these in modes off and hpa, where nothing scrapes the pods).
The reconcile also keeps status.modelSummary (the Model column) and reads the pods' termination
messages: models that do not fit the device make the service Degraded (misfit).
(spec.replicas, in modes operator and hpa, mirrors the live count: reconcile.mirror_count.)
"""

from __future__ import annotations

import datetime

from embedop import drift

# FieldNotPersisted: a render held because the API server does not store it as sent (write.py). Its
# own condition, not Degraded: what holds it is often harmless (a policy pinning an image's digest,
# a webhook adding a default), the fleet itself is fine, and a Degraded renewed every hour would
# fail Argo CD's and Flux's health checks for good.
RECONCILE_CONDITIONS = ("Ready", "Progressing", "Degraded", drift.FIELD_NOT_PERSISTED)
TASK_MISMATCH = "TaskMismatch"
# Ready's reason for a service at zero replicas: on purpose (mode off, spec.replicas 0: Ready True), or
# scaled to zero by KEDA in mode keda (Ready False: ready_condition says why).
SCALED_TO_ZERO = "ScaledToZero"
AUTOSCALER_CONDITIONS = ("ScalingLimited", "MetricsUnavailable", TASK_MISMATCH)
# Modes where the operator's autoscaler scrapes the pods and decides (in keda, for KEDA to apply).
AUTOSCALER_MODES = ("operator", "keda")
MEASURED = ("serviceRateTokensPerSecond", "arrivalRateTokensPerSecond", "estimatedDrainMs")
# What a server writes first in its termination message when its models do not fit the device
# (server/embedserve/model/device.py MISFIT_PREFIX; the operator's image does not hold the server).
MISFIT_PREFIX = "models do not fit the device: "
MISFIT = "ModelsDoNotFit"  # Degraded's reason then
SERVER_CONTAINER = "server"
# The measured rates are refreshed at most this often (with a decision or condition that changes,
# at once): Prometheus has the live series, and a status write is an etcd write and a watch event
# for every client watching services.
MEASURED_REFRESH_S = 60.0
# A measurement (tokens/s, ms) is rewritten only when it has moved by more than this fraction, and by
# more than the floor: the gauges move a little at every scrape, and a status write per interval per
# service costs as many etcd writes and watch events (kopf's, kubectl's, dashboards') for nothing.
MEASURED_CHANGE, MEASURED_FLOOR = 0.02, 1.0
MEASURED_DIGITS = 3  # significant digits written


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int | None, previous: list[dict],
              now: str) -> dict:
    """A condition (`ok` None: Unknown); lastTransitionTime moves only when the status flips."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    before = next((c for c in previous or [] if c.get("type") == type_), None)
    since = before["lastTransitionTime"] if before and before.get("status") == status and before.get("lastTransitionTime") else now
    c = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def significant(x: float, digits: int = MEASURED_DIGITS) -> float:
    return float(f"{x:.{digits}g}")


def steady(previous: dict, measured: dict[str, float], due: bool = True) -> dict[str, float]:
    """`measured` to write: each value rounded to MEASURED_DIGITS, or the previous one kept where it
    has not moved meaningfully, or where a refresh is not `due` (so an unchanged decision writes
    nothing). A value never written yet is written."""
    out = {}
    for key, value in measured.items():
        before = previous.get(key)
        moved = not isinstance(before, (int, float)) or due and abs(value - before) > max(
            MEASURED_CHANGE * max(abs(value), abs(before)), MEASURED_FLOOR)
        out[key] = significant(value) if moved else before
    return out


def differs(new: dict, previous: dict, subset) -> bool:
    """Whether writing `new` (merge-patch semantics: None removes a field) changes `previous`. A
    list of named entries (status.models) is the same only with the same names in the same order
    (`subset` lets a stored list keep entries of others)."""
    def names(v) -> list | None:
        return [e.get("name") for e in v] if isinstance(v, list) and all(isinstance(e, dict) for e in v) else None
    return any(k in previous if v is None else k not in previous or not subset(v, previous[k])
               or names(v) != names(previous[k]) for k, v in new.items())


def merge_conditions(previous: list[dict], ours: list[dict]) -> list[dict]:
    """`previous` with our conditions replaced where they stand (others' kept untouched, the
    order stable), new ones appended."""
    mine = {c["type"]: c for c in ours}
    out = [mine.pop(c.get("type"), c) for c in previous or []]
    return out + list(mine.values())


def from_deployment(deployment: dict | None, wanted: int | None, problems: list[str], generation: int | None,
                    previous: list[dict], now: str | None = None, rejected: str | None = None,
                    foreign: list[str] | None = None, fill: tuple[str, str] | None = None,
                    missing: tuple[str, str] | None = None, unpersisted: list[str] | None = None,
                    misfit: str | None = None, zero_is_ready: bool = True) -> dict:
    """Replica counts and Ready / Progressing / Degraded from the Deployment's status; `rejected`
    is the API's message when it refused an object the spec rendered; `unpersisted`, the messages
    of renders held because the API server does not store them as sent (write.py: the
    FieldNotPersisted condition, not Degraded); `missing`, (reason, message)
    when the cluster does not serve a kind the spec asks for (a CRD not installed); `foreign`, the objects of
    the service's names that someone else owns (never applied over); `fill`, (state, message) of
    a model cache's fill Job the pods wait for (Failed: Degraded; else Progressing). A fill that
    runs while a Deployment exists (a new revision) hides nothing of the fleet's own state: a
    failing rollout or a missing count is still Degraded. `misfit`: a pod's termination message
    saying its models do not fit the device (misfit()): Degraded, reason ModelsDoNotFit, with it.
    `zero_is_ready`: ready_condition's, whether zero pods wanted and left is Ready."""
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
    elif foreign:
        degraded = condition("Degraded", True, "NotOwned",
                             f"{', '.join(foreign)} already exist(s) and belong(s) to someone else (no ownerReference "
                             "to this EmbeddingService): not taken over; rename the service or remove them",
                             generation, previous, now)
    elif rejected:
        degraded = condition("Degraded", True, "RejectedByAPI", rejected, generation, previous, now)
    elif missing:
        degraded = condition("Degraded", True, missing[0], missing[1], generation, previous, now)
    elif fill and fill[0] == "Failed":
        degraded = condition("Degraded", True, "ModelCacheFillFailed", fill[1], generation, previous, now)
    elif fill and deployment is None:  # a first fill: no Deployment is expected before it is done
        degraded = condition("Degraded", False, "FillingModelCache", "", generation, previous, now)
    elif deployment is None:
        degraded = condition("Degraded", True, "DeploymentMissing", "the Deployment does not exist yet", generation, previous, now)
    elif misfit:
        degraded = condition("Degraded", True, MISFIT, misfit, generation, previous, now)
    elif failing:
        degraded = condition("Degraded", True, failing[0].get("reason") or "DeploymentFailing",
                             failing[0].get("message", ""), generation, previous, now)
    else:
        degraded = condition("Degraded", False, "AsExpected", "", generation, previous, now)
    healthy = deployment is not None and not problems
    progressing = healthy and (updated < wanted or ready < wanted or replicas > wanted)
    filling = bool(fill) and fill[0] != "Failed" and not problems
    return {
        "replicas": replicas,
        "readyReplicas": ready,
        "conditions": merge_conditions(previous, [
            ready_condition(healthy, ready, replicas, wanted, generation, previous, now, zero_is_ready),
            condition("Progressing", True, "FillingModelCache", fill[1], generation, previous, now) if filling else
            condition("Progressing", progressing, "RollingOut" if progressing else "Stable",
                      f"{updated} updated, {ready} ready, {replicas} existing, {wanted} wanted", generation, previous, now),
            degraded,
            condition(drift.FIELD_NOT_PERSISTED, True, "Held", "; ".join(unpersisted), generation, previous, now)
            if unpersisted else condition(drift.FIELD_NOT_PERSISTED, False, "StoredAsSent", "", generation, previous, now),
        ]),
    }


def ready_condition(healthy: bool, ready: int, replicas: int, wanted: int, generation: int | None,
                    previous: list[dict], now: str, zero_is_ready: bool = True) -> dict:
    """Ready: every wanted replica is ready, and at least one is wanted; or, with none wanted (mode
    off at spec.replicas 0: stopped on purpose), none is left: True, reason SCALED_TO_ZERO.

    True at zero as Kubernetes' own objects read it: a Deployment at 0 replicas is Available, a
    Knative service or KEDA ScaledObject scaled to zero is Ready. Ready says the service is as asked
    and nothing is wrong; readyReplicas says how many pods serve. False would hold `kubectl wait
    --for=condition=Ready`, Argo CD's and Flux's health and alerts on a state the user asked for.
    Pods still running down (replicas > 0) are not there yet: False, ReplicasNotReady.

    Not `zero_is_ready` (mode keda, scaled to zero by KEDA after idleSeconds without demand): False,
    reason SCALED_TO_ZERO. The service answers, but only after a pod's start (the HTTP add-on holds
    the first requests meanwhile): a check that waits for Ready before sending traffic must not take
    zero for a service ready to answer within its usual latency."""
    if healthy and wanted == 0 and replicas == 0 and zero_is_ready:
        return condition("Ready", True, SCALED_TO_ZERO, "scaled to zero on purpose: no pod runs (spec.replicas 0)",
                         generation, previous, now)
    if healthy and wanted == 0 and replicas == 0:
        return condition("Ready", False, SCALED_TO_ZERO, "scaled to zero by KEDA after idleSeconds without demand: the "
                         "next request wakes it (held by KEDA's HTTP add-on while a pod starts)", generation, previous, now)
    is_ready = healthy and wanted > 0 and ready >= wanted
    return condition("Ready", is_ready, "ReplicasReady" if is_ready else "ReplicasNotReady",
                     f"{ready}/{wanted} replicas ready", generation, previous, now)


def served_task(tasks: list[str | None], previous: str | None) -> str | None:
    """status.task from the scraped pods' task labels (None: a pod whose server exports none, an
    image older than the label): the one the labelled pods agree on; `previous` while they
    disagree (a rollout from one task to another) or no pod was scraped; None when pods were
    scraped and none says (a rollback to such an image: an old value would go stale)."""
    said = {t for t in tasks if t}
    if len(said) == 1:
        return said.pop()
    return previous if said or not tasks else None


def task_mismatch(wanted: str | None, served: str | None, generation: int | None, previous: list[dict],
                  now: str) -> dict | None:
    """The TaskMismatch condition: True when the task the pods are told (`wanted`: spec.task, or
    TASK in spec.env) is set and they serve another. None (no condition) while the served task is
    unknown."""
    if served is None:
        return None
    if wanted and wanted != served:
        return condition(TASK_MISMATCH, True, "TaskDiffers",
                         f"spec.task is {wanted} but the pods serve {served}: a rollout to {wanted} is under way, "
                         f"or the new pods cannot start with TASK={wanted} (see their logs)", generation, previous, now)
    return condition(TASK_MISMATCH, False, "AsSpecified" if wanted else "Inferred",
                     f"the pods serve {served}" + ("" if wanted else " (inferred by the server: no spec.task or TASK)"),
                     generation, previous, now)


def _env(container: dict) -> list[tuple]:
    return [(e.get("name"), e.get("value")) for e in container.get("env") or []]


def misfit(pods: list[dict], template: dict | None = None) -> str | None:
    """The message of a server pod whose models do not fit its device (its server container's
    termination message, MISFIT_PREFIX and the numbers; Kubernetes' default terminationMessagePath,
    which the server writes before it exits 1), with the pod's name; None when no pod says so. The
    container's last termination counts while it is not ready again (crash-looping on it), its
    present one always; pods being deleted not at all, nor, given the Deployment's pod `template`,
    pods of an older one (their server's env differs: a fixed spec's rollout replaces them one by
    one, minutes apart, and they would keep saying what no longer holds)."""
    wanted = next((_env(c) for c in ((template or {}).get("spec") or {}).get("containers") or []
                   if c.get("name") == SERVER_CONTAINER), None)
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        own = next((_env(c) for c in (pod.get("spec") or {}).get("containers") or []
                    if c.get("name") == SERVER_CONTAINER), None)
        if wanted is not None and own is not None and own != wanted:
            continue
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            if c.get("name") != SERVER_CONTAINER:
                continue
            now = ((c.get("state") or {}).get("terminated") or {}).get("message") or ""
            last = ((c.get("lastState") or {}).get("terminated") or {}).get("message") or ""
            for message in (now, "" if c.get("ready") else last):
                if message.startswith(MISFIT_PREFIX):
                    return (f"{message.strip()} (pod {pod['metadata']['name']}: it cannot start; serve fewer or smaller "
                            f"models per pod, or give it a device with more memory)")
    return None


def served_models(names: list[str], tasks: dict[str, list[str | None]], capacities: dict[str, float],
                  offered: dict[str, float], previous: list[dict] | None, due: bool) -> list[dict]:
    """status.models, in spec.models' order (`names`): each model's served task (served_task over
    the pods' labels, `previous`'s while they disagree or none was read), its capacity (tokens/s of
    its busy time per replica) and its offered tokens/s, the measurements held as `steady` holds
    the service's own."""
    before = {m.get("name"): m for m in previous or []}
    out = []
    for name in names:
        last = before.get(name, {})
        task = served_task(tasks.get(name, []), last.get("task"))
        measured = {**({"serviceRateTokensPerSecond": capacities[name]} if name in capacities else {}),
                    **({"arrivalRateTokensPerSecond": offered[name]} if name in offered else {})}
        out.append({"name": name, **({"task": task} if task else {}), **steady(last, measured, due)})
    return out


def models_mismatch(wanted: dict[str, str | None], served: dict[str, str | None], generation: int | None,
                    previous: list[dict], now: str) -> dict | None:
    """TaskMismatch with spec.models: True when a model told its task (`wanted`, by name) serves
    another; None while no model's served task is known."""
    known = {name: task for name, task in served.items() if task}
    if not known:
        return None
    differ = [f"models[{n}].task is {wanted[n]} but the pods serve {t}" for n, t in known.items() if wanted.get(n) and wanted[n] != t]
    if differ:
        return condition(TASK_MISMATCH, True, "TaskDiffers", "; ".join(differ) + ": a rollout is under way, or the new "
                         "pods cannot start with it (see their logs)", generation, previous, now)
    told = any(wanted.get(n) for n in known)
    return condition(TASK_MISMATCH, False, "AsSpecified" if told else "Inferred",
                     "the pods serve " + ", ".join(f"{n}: {t}" for n, t in known.items()), generation, previous, now)
