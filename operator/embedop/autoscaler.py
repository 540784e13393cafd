"""One autoscaling step for one EmbeddingService (mode: operator): take its pods from the watch's
copies, read them (scrape.Reader), decide, scale, record. The decision itself is
autoscale.decide (pure); this module is its I/O.

The count changes through the same render and apply as the reconcile (deployment_for), guarded by
the Deployment's resourceVersion: one writer of the field (field manager embedop), and a decision
taken on a count that has changed meanwhile is dropped rather than applied. When admission refuses
the whole Deployment, the count still changes, through the scale subresource
(reconcile.apply_deployment). Right after a change the service's spec.replicas is set to it
(reconcile.mirror_count), so that a switch to mode off keeps the fleet as it is. Before the count
goes down, the pods to remove (the idlest) get the lowest pod-deletion-cost (autoscale.removal_marks),
so that the ReplicaSet removes those: only once the Deployment, read fresh, still has the count
decided on (the apply is guarded by that read), a few patches at a time; marks a dropped decision
left are cleared at a later step, once no scale-down is under way.

A settled service costs no API request: the Deployment, the service and the pods are read from the
watches, and status is written only when the decision or a condition changes (the measured rates
at most once a minute, status.MEASURED_REFRESH_S)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from embedop import autoscale, crd, demand, fill as fills, render, reconcile, render_models, scrape, spec as specs, status
from embedop.cache import Cluster, NotLeader
from embedop.config import OperatorSettings
from embedop.decisions import Decisions
from embedop.kube import Conflict, NotFound, Rejected, Retryable
from embedop.scrape import Reader, unscraped

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Step:
    history: autoscale.History  # for the next step
    decision: autoscale.Decision | None  # None: nothing to scale (not mode operator, gone, invalid)
    current: int  # the count it was decided on
    body: dict | None  # the service as read
    unscraped: str | None = None  # see scrape.unscraped()
    refused: str | None = None  # admission refused the Deployment: the count changed through /scale


async def step(cluster: Cluster, settings: OperatorSettings, reader: Reader, namespace: str,
               name: str, history: autoscale.History, now: float, measured_due: bool = True,
               decisions: Decisions | None = None) -> Step:
    """`measured_due`: the measured rates in status may be refreshed (status.MEASURED_REFRESH_S).
    Mode keda: the same decision, published for KEDA (`decisions`, read by embedop.scaler) where
    mode operator writes it: KEDA's HPA sets the count."""
    # First, as reconcile does; and only ours (a Deployment of this name that is not is the
    # reconcile's to report, not ours to read from the API at every step).
    live = await cluster.get("Deployment", namespace, name, ours=True)
    body = await cluster.get(crd.KIND, namespace, name)
    if live is None or body is None or body["metadata"].get("deletionTimestamp"):
        return Step(history, None, 0, body)
    spec = specs.defaulted(body.get("spec") or {})
    mode = spec["autoscaling"]["mode"]
    if mode != "keda" and decisions is not None:
        decisions.forget((namespace, name))
    if (mode not in ("operator", "keda") or specs.problems(spec, name)
            or reconcile.not_ours(live, reconcile.owner_of(body))):
        return Step(history, None, 0, body)
    current = int(live["spec"].get("replicas") or 0)
    errors: dict[str, str] = {}
    ports = scrape.ports(spec, settings.metrics_port)
    pods = cluster.pods(namespace, render.selector(name))
    samples = await reader.scrape(pods, ports, settings.scrape_timeout_s, errors)
    decision = autoscale.decide(samples, current, autoscale.Policy.from_spec(spec["autoscaling"], spec["admission"]), history, now)
    blind = unscraped(samples, errors, ports, len(decision.saturated))
    refused = None
    if mode == "keda":
        if decisions is not None:
            # Pods that serve but cannot be read are demand too: idle is what was read as idle.
            demanded = decision.offered > 0 or decision.load > 0 or blind is not None
            decisions.publish((namespace, name), decision.desired, demanded, spec["autoscaling"]["idleSeconds"], now,
                              running=current > 0)
        # KEDA's HPA removes the pods: the idlest are marked for the ReplicaSet to pick, as mode
        # operator marks them; once no scale-down is under way, the marks go.
        alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if decision.desired < current or len(alive) <= current:
            await _mark(cluster, namespace, autoscale.removal_marks(samples, _annotations(alive),
                                                                    max(0, current - decision.desired), _template_cost(live)))
    elif decision.desired != current:
        scaled, refused = await _scale(cluster, settings, body, spec, live, decision.desired, samples)
        if not scaled:
            decision = dataclasses.replace(decision, desired=current, reason="the count changed meanwhile: decide again")
    elif len(alive := [p for p in pods if not p["metadata"].get("deletionTimestamp")]) <= current:
        # No scale-down under way (the ReplicaSet has removed its surplus): a dropped decision's marks go.
        await _mark(cluster, namespace, autoscale.removal_marks(samples, _annotations(alive), 0, _template_cost(live)))
    await _write_status(cluster, namespace, name, spec, decision, samples, current, unscraped=blind, due=measured_due,
                        acted_on=body["metadata"].get("generation"))
    return Step(decision.history, decision, current, body, blind, refused)


MARK_CONCURRENCY = 4  # pods patched at once: a scale-down of many pods is not a burst of requests


def _annotations(pods: list[dict]) -> dict[str, dict]:
    return {p["metadata"]["name"]: p["metadata"].get("annotations") or {} for p in pods}


def _template_cost(deployment: dict) -> str | None:
    """The pod-deletion-cost the pod template gives (spec.podAnnotations), if any."""
    template = (deployment.get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(autoscale.DELETION_COST)


async def _mark(cluster: Cluster, namespace: str, marks: dict[str, dict[str, str | None]]) -> None:
    """Merge `marks` (autoscale.removal_marks) into the pods, MARK_CONCURRENCY at a time. Best
    effort: a pod gone meanwhile, a refusal (RBAC without patch on pods: a chart from before this
    call) or an outage never holds the scale-down back."""
    limit = asyncio.Semaphore(MARK_CONCURRENCY)

    async def one(pod: str, annotations: dict[str, str | None]) -> None:
        async with limit:
            try:
                await cluster.annotate("Pod", namespace, pod, annotations)
            except NotLeader:
                raise
            except NotFound:
                pass
            except (Rejected, Retryable) as e:
                log.warning("%s/%s: deletion cost not set (%s); the ReplicaSet picks the pods to remove by itself",
                            namespace, pod, e)

    await asyncio.gather(*(one(pod, annotations) for pod, annotations in marks.items()))


async def _scale(cluster: Cluster, settings: OperatorSettings, body: dict, spec: dict, live: dict,
                 desired: int, samples: list[autoscale.PodSample] = ()) -> tuple[bool, str | None]:
    """Apply the service's Deployment with the new count (through the scale subresource when
    admission refuses the whole spec), then mirror it into spec.replicas. A scale-down first reads
    the Deployment from the API and marks the pods to remove (`samples`: their readings) only
    while it still has the count decided on; the apply is guarded by that read. → (False when the
    Deployment changed since it was read and its count is no longer the one decided on: the next
    step decides again; the refusal's message when the fallback was taken)."""
    current = live["spec"].get("replicas")
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for attempt in range(reconcile.CONFLICT_RETRIES):
        if desired < current:
            if attempt == 0:  # (after a Conflict, `live` was read fresh below)
                live = await cluster.get("Deployment", namespace, name, fresh=True)
                if live is None or live["spec"].get("replicas") != current:
                    return False, None
            alive = [p for p in cluster.pods(namespace, render.selector(name)) if not p["metadata"].get("deletionTimestamp")]
            await _mark(cluster, namespace, autoscale.removal_marks(samples, _annotations(alive), current - desired,
                                                                    _template_cost(live)))
        deployment, _ = reconcile.deployment_for(settings, body, spec, live, desired)
        # While a model cache's fill runs, the count changes but the pods stay on the revision they have.
        fill = await fills.read(cluster, settings, reconcile.owner_of(body), spec,
                                deployment["spec"]["template"]["spec"]["containers"][0]["image"], body)
        try:
            refused = await reconcile.apply_deployment(cluster, deployment, live, hold=bool(fill and fill.holds))
        except Conflict:
            live = await cluster.get("Deployment", namespace, name, fresh=True)
            if live is None or live["spec"].get("replicas") != current:
                return False, None
            body = await cluster.get(crd.KIND, namespace, name, fresh=True) or body
            spec = specs.defaulted(body.get("spec") or {})
            continue
        if (count := render.mirrored_replicas(spec, desired)) is not None:
            try:
                await reconcile.mirror_count(cluster, body, count)
            except Rejected as e:  # the reconcile tries again, and reports it as Degraded
                log.warning("%s/%s: spec.replicas not updated: %s", namespace, name, e)
        return True, refused
    return False, None


async def _write_status(cluster: Cluster, namespace: str, name: str, spec: dict, decision: autoscale.Decision,
                        samples: list[autoscale.PodSample], current: int, body: dict | None = None,
                        unscraped: str | None = None, due: bool = True, acted_on: int | None = None) -> None:
    """The autoscaler's status fields (see status.py); `body`: a read to start from. The
    measurements are written only when one has moved meaningfully and a refresh is `due`, or
    with a change of the decision or a condition (status.steady): a write per interval per service
    would be as many watch events and etcd writes for nothing."""
    scraped = [s for s in samples if s.scraped]
    # With spec.models: the service rate is the first (default) model's, each model's in
    # status.models; the drain is a pod's device time queued, every model's (demand.drain_s).
    names, caps = [m["name"] for m in spec.get("models") or []], dict(decision.capacities)
    measured = {
        "serviceRateTokensPerSecond": (caps.get(names[0]) if names else None) or decision.capacity or 0.0,
        "arrivalRateTokensPerSecond": decision.offered,
        "estimatedDrainMs": max((demand.drain_s(s.readings()) * 1000 for s in scraped), default=0.0),
    }
    tasks = demand.tasks([s.readings() for s in scraped])
    # Mode keda: the count is KEDA's HPA's to set and the reconcile's to report (its wish); the
    # decision is what the scaler tells it (embedop.scaler), not a scale of ours.
    new: dict = {}
    if spec["autoscaling"]["mode"] == "operator":
        new["desiredReplicas"] = decision.desired
        if decision.desired != current:
            new.update(lastScaleTime=status.now_iso(), lastScaleReason=decision.reason)
    maximum = spec["autoscaling"]["maxReplicas"]
    reason = (("Saturated" if decision.saturated else "ScrapeFailed") if unscraped else
              "Scraped" if scraped else "NoReadyPods")

    def compute(fresh: dict) -> dict:
        previous = fresh.get("status") or {}
        generation = reconcile.observed(fresh, spec, acted_on)
        now, before = status.now_iso(), previous.get("conditions") or []
        limited = status.condition(
            "ScalingLimited", decision.limited, "AtMaxReplicas" if decision.limited else "WithinBounds",
            f"demand needs {decision.needed} replicas; maxReplicas is {maximum}" if decision.limited else "",
            generation, before, now)
        metrics = status.condition("MetricsUnavailable", unscraped is not None, reason, unscraped or "",
                                   generation, before, now)
        # The served task changes only with the pods' model or TASK: written when it does, not
        # held back like the measurements (and a fleet at rest writes nothing).
        if names:  # each model's task, in spec.models' order; status.task joins them (the Task column)
            served = {m["name"]: m.get("task") for m in status.served_models(names, tasks, {}, {}, previous.get("models"), False)}
            task = ",".join(dict.fromkeys(t for t in served.values() if t)) or None
            mismatch = status.models_mismatch(render_models.wanted_tasks(spec), served, generation, before, now)
        else:
            task = status.served_task([s.task for s in scraped], previous.get("task"))
            mismatch = status.task_mismatch(specs.task(spec), task, generation, before, now)
        conditions = status.merge_conditions(before, [limited, metrics, *([mismatch] if mismatch else [])])
        if mismatch is None:  # no served task known: no verdict on it
            conditions = [c for c in conditions if c.get("type") != status.TASK_MISMATCH]
        # The task is not among what makes the measurements due: it is written on its own.
        changed = previous.get("desiredReplicas") != new.get("desiredReplicas", previous.get("desiredReplicas")) \
            or conditions != before
        models = status.served_models(names, tasks, caps, dict(decision.offered_by_model), previous.get("models"),
                                      due or changed) if names else None
        return {**new, **status.steady(previous, measured, due or changed), "conditions": conditions,
                "task": task, "models": models}

    await reconcile.update_status(cluster, namespace, name, compute, body)
