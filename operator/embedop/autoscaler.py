"""One autoscaling step for one EmbeddingService (mode: operator): take its pods from the watch's
copies, scrape each serving pod's /metrics concurrently with a short timeout, decide, scale,
record. The decision itself is autoscale.decide (pure); this module is its I/O.

The count changes through the same render and apply as the reconcile (deployment_for), guarded by
the Deployment's resourceVersion: one writer of the field (field manager embedop), and a decision
taken on a count that has changed meanwhile is dropped rather than applied. When admission refuses
the whole Deployment, the count still changes, through the scale subresource
(reconcile.apply_deployment). Right after a change the service's spec.replicas is set to it
(reconcile.mirror_count), so that a switch to mode off keeps the fleet as it is.

A settled service costs no API request: the Deployment, the service and the pods are read from the
watches, and status is written only when the decision or a condition changes (the measured rates
at most once a minute, status.MEASURED_REFRESH_S)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from embedop import autoscale, crd, fill as fills, render, reconcile, spec as specs, status
from embedop.cache import Cluster
from embedop.config import OperatorSettings
from embedop.kube import Conflict, Rejected

log = logging.getLogger(__name__)

# The shared signal: Prometheus sample name → autoscale.PodSample field (one entry per metric).
METRICS = {
    "embedfleet_service_rate_tokens_per_second": "service_rate",
    "embedfleet_arrival_rate_tokens_per_second": "arrival_rate",
    "embedfleet_queued_tokens": "queued_tokens",
    "embedfleet_offered_tokens_total": "offered_total",
    "embedfleet_model_busy_seconds_total": "busy_seconds",
    "embedfleet_admission_backlog_limit_seconds": "backlog_limit_s",
}


# The series a server must export for its demand and capacity to be read (DESIGN's shared signal);
# an answer without them (another program on the port, an incompatible version) is blind, not zero.
REQUIRED = ("service_rate", "arrival_rate", "queued_tokens")


# The info series that says what a server serves; its `task` label is reported in status.task.
MODEL_INFO, TASK_LABEL = "embedfleet_model_info", "task"


def read_exposition(text: str) -> tuple[dict[str, float], str | None]:
    """→ (the METRICS samples of a Prometheus text exposition, as PodSample fields (a metric
    exported with labels is summed over them); the task its MODEL_INFO labels, None without one)."""
    out: dict[str, float] = {}
    task = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                out[METRICS[sample.name]] = out.get(METRICS[sample.name], 0.0) + float(sample.value)
            elif sample.name == MODEL_INFO and sample.labels.get(TASK_LABEL):
                task = sample.labels[TASK_LABEL]
    return out, task


def parse_metrics(text: str) -> dict[str, float]:
    """The METRICS samples of a Prometheus text exposition, as PodSample fields."""
    return read_exposition(text)[0]


def _time(value: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    ready: bool
    served: bool  # the API shows it has been Ready, though it is not now
    startup_s: float | None  # creation → Ready, when that Ready follows the container's start


# Ready's transition to False this long after the pod started is a flip, not the status the
# kubelet first writes (with status.startTime, give or take a moment).
FLIP_AFTER_START_S = 5.0


def pod_view(pod: dict, startup_allowance_s: float = render.STARTUP_ALLOWANCE_S) -> PodView | None:
    """What the autoscaler needs of a Pod, as the API keeps it (an operator restart forgets
    nothing): None for a pod being deleted (it leaves the fleet, whatever its state).

    A pod that is not Ready has served when its containers are `started` (the kubelet keeps that
    from the startup probe's success until a container restarts or the kubelet loses its state),
    or when Ready turned False after the pod started (the kubelet writes Ready=False at its first
    sync, with status.startTime; a later transition is a flip from True, and stays the first
    crash's through a crash loop): an overloaded pod, a node gone NotReady, a container that
    crashed and restarts. A pod that failed for good (evicted) is gone from the fleet. Start-up time is creation → Ready, measured
    only where that Ready is the container's first (no restart, and within the startup probe's
    allowance of the container's start): after a flap, Ready's lastTransitionTime is the flap's."""
    st = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or st.get("phase") in ("Failed", "Succeeded"):
        return None  # leaving, or gone for good (evicted: its model cache over its limit, a node shut down)
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
    ready = cond.get("status") == "True"
    containers = st.get("containerStatuses") or []
    created, changed = _time(pod["metadata"].get("creationTimestamp")), _time(cond.get("lastTransitionTime"))
    running = [_time(((c.get("state") or {}).get("running") or {}).get("startedAt")) for c in containers]
    began = _time(st.get("startTime"))
    flipped = changed is not None and began is not None and (changed - began).total_seconds() > FLIP_AFTER_START_S
    served = not ready and ((bool(containers) and all(c.get("started") for c in containers)) or flipped)
    first = not any(c.get("restartCount") for c in containers) and all(
        t is None or changed is None or (changed - t).total_seconds() <= startup_allowance_s for t in running)
    startup = (changed - created).total_seconds() if ready and first and created and changed else None
    return PodView(pod["metadata"]["name"], st.get("podIP"), ready, served, startup)


def metrics_url(ip: str, port: int) -> str:
    """An IPv6 literal goes in brackets (IPv6-only and IPv6-first dual-stack clusters)."""
    host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
    return f"http://{host}:{port}/metrics"


async def scrape(session: aiohttp.ClientSession, pods: list[dict], port: int, timeout: float,
                 errors: dict[str, str] | None = None) -> list[autoscale.PodSample]:
    """Every pod that has served (Ready, or turned unready: it may still carry load) is scraped. `errors`, when given, gets each failed scrape's error by pod name."""
    async def one(view: PodView):
        base = dict(name=view.name, ready=view.ready, served=view.served, startup_s=view.startup_s)
        if not (view.ready or view.served) or not view.ip:
            return autoscale.PodSample(scraped=False, **base)
        try:
            async with session.get(metrics_url(view.ip, port), timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                r.raise_for_status()
                values, task = read_exposition(await r.text())
            if missing := [f for f in REQUIRED if f not in values]:
                raise ValueError("no " + ", ".join(k for k, v in METRICS.items() if v in missing) +
                                 " in its /metrics: not an embedfleet server, or an incompatible version")
            return autoscale.PodSample(scraped=True, **base, **values, task=task)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            if errors is not None:
                errors[view.name] = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {timeout:g} s"
            return autoscale.PodSample(scraped=False, **base)

    views = [v for v in map(pod_view, pods) if v is not None]
    return list(await asyncio.gather(*(one(v) for v in views)))


def unscraped(samples: list[autoscale.PodSample], errors: dict[str, str], port: int) -> str | None:
    """Why no ready pod could be read on `port` (render.health_port), or None when one was (or none
    is ready yet). Failed scrapes hold the count (autoscale.decide): said in status and an Event,
    not left to be noticed."""
    ready = sorted(s.name for s in samples if s.ready)
    if not ready or any(s.scraped for s in samples if s.ready):
        return None
    causes = ("a NetworkPolicy that keeps the operator from that port" if port == render.HTTP_PORT else
              "a NetworkPolicy that keeps the operator from the pods' metrics port, or a server image from "
              "before the metrics port (spec.auth, spec.tls and spec.networkPolicy need one that has it)")
    return (f"none of the {len(ready)} ready pod(s) could be scraped on port {port} /metrics "
            f"({ready[0]}: {errors.get(ready[0], 'failed')}); the replica count is held until one can be "
            f"({causes} does this)")


@dataclasses.dataclass(frozen=True)
class Step:
    history: autoscale.History  # for the next step
    decision: autoscale.Decision | None  # None: nothing to scale (not mode operator, gone, invalid)
    current: int  # the count it was decided on
    body: dict | None  # the service as read
    unscraped: str | None = None  # see unscraped()
    refused: str | None = None  # admission refused the Deployment: the count changed through /scale


async def step(cluster: Cluster, settings: OperatorSettings, session: aiohttp.ClientSession, namespace: str,
               name: str, history: autoscale.History, now: float, measured_due: bool = True) -> Step:
    """`measured_due`: the measured rates in status may be refreshed (status.MEASURED_REFRESH_S)."""
    # First, as reconcile does; and only ours (a Deployment of this name that is not is the
    # reconcile's to report, not ours to read from the API at every step).
    live = await cluster.get("Deployment", namespace, name, ours=True)
    body = await cluster.get(crd.KIND, namespace, name)
    if live is None or body is None or body["metadata"].get("deletionTimestamp"):
        return Step(history, None, 0, body)
    spec = specs.defaulted(body.get("spec") or {})
    if (spec["autoscaling"]["mode"] != "operator" or specs.problems(spec, name)
            or reconcile.not_ours(live, reconcile.owner_of(body))):
        return Step(history, None, 0, body)
    current = int(live["spec"].get("replicas") or 0)
    errors: dict[str, str] = {}
    port = render.health_port(spec, settings.metrics_port)  # where the kubelet probes them too
    samples = await scrape(session, cluster.pods(namespace, render.selector(name)), port,
                           settings.scrape_timeout_s, errors)
    blind = unscraped(samples, errors, port)
    decision = autoscale.decide(samples, current, autoscale.Policy.from_spec(spec["autoscaling"], spec["admission"]), history, now)
    refused = None
    if decision.desired != current:
        scaled, refused = await _scale(cluster, settings, body, spec, live, decision.desired)
        if not scaled:
            decision = dataclasses.replace(decision, desired=current, reason="the count changed meanwhile: decide again")
    await _write_status(cluster, namespace, name, spec, decision, samples, current, unscraped=blind, due=measured_due,
                        acted_on=body["metadata"].get("generation"))
    return Step(decision.history, decision, current, body, blind, refused)


async def _scale(cluster: Cluster, settings: OperatorSettings, body: dict, spec: dict, live: dict,
                 desired: int) -> tuple[bool, str | None]:
    """Apply the service's Deployment with the new count (through the scale subresource when
    admission refuses the whole spec), then mirror it into spec.replicas. → (False when the
    Deployment changed since it was read and its count is no longer the one decided on: the next
    step decides again; the refusal's message when the fallback was taken)."""
    current = live["spec"].get("replicas")
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for _ in range(reconcile.CONFLICT_RETRIES):
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
    measured = {
        "serviceRateTokensPerSecond": decision.capacity or 0.0,
        "arrivalRateTokensPerSecond": decision.offered,
        "estimatedDrainMs": max((s.queued_tokens / s.service_rate * 1000 for s in scraped if s.service_rate > 0),
                                default=0.0),
    }
    new: dict = {"desiredReplicas": decision.desired}
    if decision.desired != current:
        new.update(lastScaleTime=status.now_iso(), lastScaleReason=decision.reason)
    maximum = spec["autoscaling"]["maxReplicas"]
    reason = "ScrapeFailed" if unscraped else ("Scraped" if scraped else "NoReadyPods")

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
        task = status.served_task([s.task for s in scraped], previous.get("task"))
        mismatch = status.task_mismatch(specs.task(spec), task, generation, before, now)
        conditions = status.merge_conditions(before, [limited, metrics, *([mismatch] if mismatch else [])])
        if mismatch is None:  # no served task known: no verdict on it
            conditions = [c for c in conditions if c.get("type") != status.TASK_MISMATCH]
        # The task is not among what makes the measurements due: it is written on its own.
        changed = previous.get("desiredReplicas") != decision.desired or conditions != before
        return {**new, **status.steady(previous, measured, due or changed), "conditions": conditions,
                "task": task}

    await reconcile.update_status(cluster, namespace, name, compute, body)
