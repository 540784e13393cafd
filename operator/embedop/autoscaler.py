"""One autoscaling step for one EmbeddingService (mode: operator): list its pods, scrape each
ready pod's /metrics concurrently with a short timeout, decide, scale, record. The decision
itself is autoscale.decide (pure); this module is its I/O.

The count changes through the same render and apply as the reconcile (deployment_for), guarded by
the Deployment's resourceVersion: one writer of the field (field manager embedop), and a decision
taken on a count that has changed meanwhile is dropped rather than applied. Right after a change
the service's spec.replicas is set to it (reconcile.mirror_count), so that a switch to mode off
keeps the fleet as it is."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from embedop import autoscale, crd, render, reconcile, spec as specs, status
from embedop.config import OperatorSettings
from embedop.kube import Conflict, Kube, Rejected

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


def parse_metrics(text: str) -> dict[str, float]:
    """The METRICS samples of a Prometheus text exposition, as PodSample fields (a metric exported
    with labels is summed over them)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                out[METRICS[sample.name]] = out.get(METRICS[sample.name], 0.0) + float(sample.value)
    return out


def _time(value: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def pod_view(pod: dict) -> tuple[str, str | None, bool, float | None]:
    """→ (name, podIP, ready, seconds from creation to ready)."""
    st = pod.get("status") or {}
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
    ready = cond.get("status") == "True" and not pod["metadata"].get("deletionTimestamp")
    created, became_ready = _time(pod["metadata"].get("creationTimestamp")), _time(cond.get("lastTransitionTime"))
    startup = (became_ready - created).total_seconds() if ready and created and became_ready else None
    return pod["metadata"]["name"], st.get("podIP"), ready, startup


async def scrape(session: aiohttp.ClientSession, pods: list[dict], port: int, timeout: float,
                 errors: dict[str, str] | None = None) -> list[autoscale.PodSample]:
    """`errors`, when given, gets each failed scrape's error by pod name."""
    async def one(pod):
        name, ip, ready, startup = pod_view(pod)
        if not ready or not ip:
            return autoscale.PodSample(name, False, False, startup_s=startup)
        try:
            async with session.get(f"http://{ip}:{port}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                r.raise_for_status()
                text = await r.text()
            return autoscale.PodSample(name, True, True, startup_s=startup, **parse_metrics(text))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            if errors is not None:
                errors[name] = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {timeout:g} s"
            return autoscale.PodSample(name, True, False, startup_s=startup)

    return list(await asyncio.gather(*(one(p) for p in pods)))


def unscraped(samples: list[autoscale.PodSample], errors: dict[str, str], port: int) -> str | None:
    """Why no ready pod could be read, or None when one was (or none is ready yet). Failed scrapes
    hold the count (autoscale.decide): said in status and an Event, not left to be noticed."""
    ready = sorted(s.name for s in samples if s.ready)
    if not ready or any(s.scraped for s in samples if s.ready):
        return None
    return (f"none of the {len(ready)} ready pod(s) could be scraped on port {port} /metrics "
            f"({ready[0]}: {errors.get(ready[0], 'failed')}); the replica count is held until one can be "
            "(a NetworkPolicy that keeps the operator from the pods' metrics port does this)")


def owned_pods(pods: list[dict], name: str) -> list[dict]:
    """The service's pods (filtered here too: not every API server applies label selectors)."""
    want = render.selector(name)
    return [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())]


@dataclasses.dataclass(frozen=True)
class Step:
    history: autoscale.History  # for the next step
    decision: autoscale.Decision | None  # None: nothing to scale (not mode operator, gone, invalid)
    current: int  # the count it was decided on
    body: dict | None  # the service as read
    unscraped: str | None = None  # see unscraped()


async def step(kube: Kube, settings: OperatorSettings, session: aiohttp.ClientSession, namespace: str, name: str,
               history: autoscale.History, now: float) -> Step:
    live = await kube.get("Deployment", namespace, name)  # first, as reconcile does
    body = await kube.get(crd.KIND, namespace, name)
    if live is None or body is None or body["metadata"].get("deletionTimestamp"):
        return Step(history, None, 0, body)
    spec = specs.defaulted(body.get("spec") or {})
    if spec["autoscaling"]["mode"] != "operator" or specs.problems(spec):
        return Step(history, None, 0, body)
    current = int(live["spec"].get("replicas") or 0)
    pods = owned_pods(await kube.list("Pod", namespace, render.selector(name)), name)
    errors: dict[str, str] = {}
    samples = await scrape(session, pods, settings.metrics_port, settings.scrape_timeout_s, errors)
    blind = unscraped(samples, errors, settings.metrics_port)
    decision = autoscale.decide(samples, current, autoscale.Policy.from_spec(spec["autoscaling"], spec["admission"]), history, now)
    if decision.desired != current and not await _scale(kube, settings, body, spec, live, decision.desired):
        decision = dataclasses.replace(decision, desired=current, reason="the count changed meanwhile: decide again")
    await _write_status(kube, namespace, name, spec, decision, samples, current, unscraped=blind)
    return Step(decision.history, decision, current, body, blind)


async def _scale(kube: Kube, settings: OperatorSettings, body: dict, spec: dict, live: dict, desired: int) -> bool:
    """Apply the service's Deployment with the new count, then mirror it into spec.replicas.
    → False when the Deployment changed since it was read and its count is no longer the one
    decided on (the next step decides again)."""
    current = live["spec"].get("replicas")
    for _ in range(reconcile.CONFLICT_RETRIES):
        deployment, _ = reconcile.deployment_for(settings, body, spec, live, desired)
        try:
            await kube.apply(deployment)
        except Conflict:
            live = await kube.get("Deployment", body["metadata"]["namespace"], body["metadata"]["name"])
            if live is None or live["spec"].get("replicas") != current:
                return False
            body = await kube.get(crd.KIND, body["metadata"]["namespace"], body["metadata"]["name"]) or body
            spec = specs.defaulted(body.get("spec") or {})
            continue
        if (count := render.mirrored_replicas(spec, desired)) is not None:
            try:
                await reconcile.mirror_count(kube, body, count)
            except Rejected as e:  # the reconcile tries again, and reports it as Degraded
                log.warning("%s/%s: spec.replicas not updated: %s", body["metadata"]["namespace"],
                            body["metadata"]["name"], e)
        return True
    return False


async def _write_status(kube: Kube, namespace: str, name: str, spec: dict, decision: autoscale.Decision,
                        samples: list[autoscale.PodSample], current: int, body: dict | None = None,
                        unscraped: str | None = None) -> None:
    """The autoscaler's status fields (see status.py); `body`: a fresh read to start from. The
    measurements are written only when one has moved meaningfully (status.steady): a write per
    interval per service would be as many watch events and etcd writes for nothing."""
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
        generation, now, before = fresh["metadata"].get("generation"), status.now_iso(), previous.get("conditions") or []
        limited = status.condition(
            "ScalingLimited", decision.limited, "AtMaxReplicas" if decision.limited else "WithinBounds",
            f"demand needs {decision.recommendation}+ replicas; maxReplicas is {maximum}" if decision.limited else "",
            generation, before, now)
        metrics = status.condition("MetricsUnavailable", unscraped is not None, reason, unscraped or "",
                                   generation, before, now)
        return {**new, **status.steady(previous, measured),
                "conditions": status.merge_conditions(before, [limited, metrics])}

    await reconcile.update_status(kube, namespace, name, compute, body)
