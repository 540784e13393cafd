"""The fill Job of a pre-filled model cache (spec.modelCache.prefill, render_cache): read from the
watch's copies, and whether the server pods must wait for it. The reconcile creates it; neither the
reconcile nor the autoscaler rolls the Deployment's pods onto a model revision before its Job has
succeeded (pods mounting the claim read-only and offline would find nothing to load)."""

from __future__ import annotations

import dataclasses

from embedop import render, render_cache
from embedop.cache import Cluster
from embedop.config import OperatorSettings


@dataclasses.dataclass(frozen=True)
class Fill:
    name: str
    job: dict | None  # as the API has it; None: not created yet
    rendered: dict  # the Job to create when there is none
    state: str  # render_cache.fill_state: Missing, Running, Complete, Failed
    message: str

    @property
    def holds(self) -> bool:
        """The pods wait: the claim does not hold this revision yet."""
        return self.state != "Complete"


async def read(cluster: Cluster, settings: OperatorSettings, owner: render.Owner, spec: dict, image: str) -> Fill | None:
    """The fill this spec needs, or None (no pre-filled claim)."""
    job = render.fill_job(owner, spec, image, settings.grace_seconds, settings.metrics_port)
    if job is None:
        return None
    name = job["metadata"]["name"]
    current = await cluster.get("Job", owner.namespace, name)
    return of(job, current, spec)


def of(rendered: dict, current: dict | None, spec: dict) -> Fill:
    name = rendered["metadata"]["name"]
    return Fill(name, current, rendered, render_cache.fill_state(current), render_cache.fill_message(current, name, spec))
