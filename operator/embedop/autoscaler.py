"""One autoscaling step for one EmbeddingService (mode: operator): list its pods, scrape each
ready pod's /metrics concurrently with a short timeout, decide, scale, record. The decision
itself is autoscale.decide (pure); this module is its I/O."""

from __future__ import annotations

import asyncio
import datetime
import re
import urllib.request

from embedop import autoscale, render, spec as specs, status
from embedop.config import OperatorSettings
from embedop.kube import Kube

GAUGES = {
    "embedfleet_service_rate_tokens_per_second": "service_rate",
    "embedfleet_arrival_rate_tokens_per_second": "arrival_rate",
    "embedfleet_queued_tokens": "queued_tokens",
    "embedfleet_offered_tokens_total": "offered_total",
}
_LINE = re.compile(r"^(embedfleet_[a-z_]+)(?:\{[^}]*\})? ([-+0-9.eEinfNa]+)$", re.M)


def parse_metrics(text: str) -> dict[str, float]:
    """The shared-signal gauges (and the offered-tokens counter) from a Prometheus text exposition."""
    return {GAUGES[m.group(1)]: float(m.group(2)) for m in _LINE.finditer(text) if m.group(1) in GAUGES}


def _time(value: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def pod_view(pod: dict) -> tuple[str, str | None, bool, float | None]:
    """→ (name, podIP, ready, seconds from creation to ready)."""
    st = pod.get("status") or {}
    cond = next((c for c in st.get("conditions", []) if c.get("type") == "Ready"), {})
    ready = cond.get("status") == "True" and not pod["metadata"].get("deletionTimestamp")
    created, became_ready = _time(pod["metadata"].get("creationTimestamp")), _time(cond.get("lastTransitionTime"))
    startup = (became_ready - created).total_seconds() if ready and created and became_ready else None
    return pod["metadata"]["name"], st.get("podIP"), ready, startup


def _fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - pod IPs from the API
        return r.read().decode()


async def scrape(pods: list[dict], port: int, timeout: float) -> list[autoscale.PodSample]:
    async def one(pod):
        name, ip, ready, startup = pod_view(pod)
        if not ready or not ip:
            return autoscale.PodSample(name, False, False, startup_s=startup)
        try:
            text = await asyncio.wait_for(asyncio.to_thread(_fetch, f"http://{ip}:{port}/metrics", timeout), timeout)
            return autoscale.PodSample(name, True, True, startup_s=startup, **parse_metrics(text))
        except (OSError, asyncio.TimeoutError, ValueError):
            return autoscale.PodSample(name, True, False, startup_s=startup)

    return list(await asyncio.gather(*(one(p) for p in pods)))


def owned_pods(pods: list[dict], name: str) -> list[dict]:
    """The service's pods (filtered here too: not every API server applies label selectors)."""
    want = render.selector(name)
    return [p for p in pods if all(p["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]


async def step(kube: Kube, settings: OperatorSettings, body: dict, history: autoscale.History,
               now: float) -> tuple[autoscale.History, autoscale.Decision | None, int]:
    """→ (next history, the decision or None when there is nothing to scale, previous replicas)."""
    spec = specs.defaulted(body.get("spec") or {})
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    if spec["autoscaling"]["mode"] != "operator" or specs.problems(spec):
        return history, None, 0
    deployment = await asyncio.to_thread(kube.get, "Deployment", ns, name)
    if deployment is None:
        return history, None, 0
    current = int(deployment["spec"].get("replicas", 0))
    pods = owned_pods(await asyncio.to_thread(kube.list_pods, ns, render.selector_string(name)), name)
    samples = await scrape(pods, settings.metrics_port, settings.scrape_timeout_s)
    decision = autoscale.decide(samples, current, autoscale.Policy.from_spec(spec["autoscaling"]), history, now)
    scraped = [s for s in samples if s.scraped]
    previous = body.get("status") or {}
    new = {
        "desiredReplicas": decision.desired,
        "serviceRateTokensPerSecond": round(decision.capacity or 0.0, 1),
        "arrivalRateTokensPerSecond": round(decision.offered, 1),
        "estimatedDrainMs": round(max((s.queued_tokens / s.service_rate * 1000 for s in scraped if s.service_rate > 0), default=0.0), 1),
    }
    if decision.desired != current:
        new.update(lastScaleTime=status.now_iso(), lastScaleReason=decision.reason)
    limited = status.condition(
        "ScalingLimited", decision.limited, "AtMaxReplicas" if decision.limited else "WithinBounds",
        f"demand needs {decision.recommendation}+ replicas; maxReplicas is {spec['autoscaling']['maxReplicas']}"
        if decision.limited else "", meta.get("generation"), previous.get("conditions", []), status.now_iso())
    conditions = [c for c in previous.get("conditions", []) if c.get("type") != "ScalingLimited"] + [limited]
    # Status first: a reconcile that runs between the two writes then agrees with the scale.
    await asyncio.to_thread(kube.patch_status, ns, name, {**new, "conditions": conditions})
    if decision.desired != current:
        await asyncio.to_thread(kube.scale_deployment, ns, name, decision.desired)
    return decision.history, decision, current
