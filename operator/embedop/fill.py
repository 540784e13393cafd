"""The fill Job of a pre-filled model cache (spec.modelCache.prefill, render_cache): read from the
watch's copies, and whether the server pods must wait for it. The reconcile creates it; neither the
reconcile nor the autoscaler rolls the Deployment's pods onto a model revision before its Job has
succeeded (pods mounting the claim read-only and offline would find nothing to load).

That a digest was filled is recorded in the service's status (status.modelCache.filled, written by
the reconcile), not only by the Job's existence: a Job deleted after it succeeded (by hand, or by a
TTL an admission policy adds) is then not run again, and the pods do not wait for it. A Job of the
fill's name that this service does not own (someone else's) proves nothing: the pods wait.

Both the Job's name and the record are a digest that includes the claim's uid (from the watch of the
namespace's claims, cache.UNLABELLED): a claim deleted and made again under the same name is a new,
empty one, filled again rather than trusted. No Job is made before its claim exists (state
NoClaim: the pods wait, the status says which claim is missing).

Operators of chart 0.2.x keyed a fill without the claim's uid (render_cache.fill_digest without
one). A fill they recorded (or whose Job of theirs succeeded) for a claim that exists counts as
Complete, once: the reconcile then records the uid-keyed digest and deletes the old Job. Without
this an upgrade would run every pre-filled fleet's fill again, and hold its pod template until
the Job succeeded, which a ReadWriteOncePod claim held by a server pod (or a ReadWriteOnce one
attached on another node) never lets happen: the Job would wait out its deadline and fail. (Such
a record cannot tell a claim made again under its name since; the upgrade trusts it as the
operator that wrote it did.)"""

from __future__ import annotations

import dataclasses

from embedop import drift, render, render_cache, write
from embedop.cache import Cluster
from embedop.config import OperatorSettings


@dataclasses.dataclass(frozen=True)
class Fill:
    name: str
    digest: str  # render_cache.fill_digest: what this spec needs filled
    job: dict | None  # as the API has it; None: none now
    rendered: dict  # the Job to create when there is none
    state: str  # render_cache.fill_state (Missing, Running, Complete, Failed), Complete when recorded, NoClaim
    message: str
    foreign: bool = False  # a Job of its name that is not this service's
    claim: dict | None = None  # the claim it fills, as watched

    @property
    def holds(self) -> bool:
        """The pods wait: the claim is not known to hold this revision."""
        return self.foreign or self.state != "Complete"

    @property
    def missing(self) -> bool:
        """No Job, and no record of this digest's fill: one is to be created."""
        return self.job is None and self.state == "Missing"


async def ensure(cluster: Cluster, settings: OperatorSettings, owner: render.Owner, spec: dict, image: str,
                 body: dict | None) -> tuple[Fill | None, list[str]]:
    """The fill this spec needs (None: no pre-filled claim), its Job created when neither it nor a
    record of its fill exists (once: a Job's template is immutable, and its name is the digest of
    what it fills; created, never applied, so a Job of its name made by someone else meanwhile is
    not taken over), never changed. Once it has succeeded, the service's fill Jobs of other
    digests go (their pods with them: a Job deleted without a propagation policy orphans its pods).
    → (the fill, "Kind/name" of what was created and "-Kind/name" of what was deleted)."""
    fill = await read(cluster, settings, owner, spec, image, body)
    if fill is None or fill.foreign:
        return fill, []
    written = []
    if fill.missing:
        job = await write.create(cluster, drift.stamped(fill.rendered), adopt=False)
        fill = of(fill.rendered, job, spec, owner, claim=fill.claim)
        written.append(f"Job/{fill.name}")
    if not fill.holds:
        for job in others(cluster, owner, fill):
            await cluster.delete("Job", owner.namespace, job["metadata"]["name"], background=True)
            written.append(f"-Job/{job['metadata']['name']}")
    return fill, written


def recorded(body: dict | None) -> str | None:
    """The digest the service's status says was filled."""
    return (((body or {}).get("status") or {}).get("modelCache") or {}).get("filled")


async def read(cluster: Cluster, settings: OperatorSettings, owner: render.Owner, spec: dict, image: str,
               body: dict | None) -> Fill | None:
    """The fill this spec needs, or None (no pre-filled claim). `body`: the service as read (its
    status's record)."""
    if render_cache.kind(spec["modelCache"]) != "prefilled":
        return None
    claim = await cluster.get("PersistentVolumeClaim", owner.namespace, spec["modelCache"]["claimName"], ours=True)
    uid = ((claim or {}).get("metadata") or {}).get("uid") or ""
    job = render.fill_job(owner, spec, image, settings.grace_seconds, settings.metrics_port, claim_uid=uid)
    if claim is None:
        return Fill(job["metadata"]["name"], job["metadata"]["labels"][render_cache.FILL_LABEL], None, job, "NoClaim",
                    render_cache.no_claim_message(spec, owner.namespace))
    current = await cluster.get("Job", owner.namespace, job["metadata"]["name"])
    digest = job["metadata"]["labels"][render_cache.FILL_LABEL]
    pods = cluster.select("Pod", owner.namespace, {render_cache.FILL_LABEL: digest,
                                                   "app.kubernetes.io/instance": owner.name})
    legacy = render.fill_job_name(owner, spec, settings.grace_seconds)  # chart 0.2.x's: no uid
    old_job = await cluster.get("Job", owner.namespace, legacy, ours=True)
    return of(job, current, spec, owner, recorded(body), pods, claim,
              migrated=migrated(recorded(body), legacy, old_job, owner))


def migrated(filled: str | None, legacy_name: str, legacy_job: dict | None, owner: render.Owner) -> bool:
    """Whether a fill of chart 0.2.x's key (`legacy_name`: `<service>-fill-<digest without the
    claim's uid>`) is known done: recorded in status, or its Job, this service's, succeeded."""
    digest = legacy_name.rpartition("-fill-")[2]
    done = legacy_job is not None and owner.owns(legacy_job) and render_cache.fill_state(legacy_job) == "Complete"
    return filled == digest or done


def of(rendered: dict, current: dict | None, spec: dict, owner: render.Owner, filled: str | None = None,
       pods: list[dict] = (), claim: dict | None = None, migrated: bool = False) -> Fill:
    """`filled`: the digest status.modelCache.filled records; `claim`: the claim it fills;
    `migrated`: chart 0.2.x's fill of the same (without the claim's uid) is done."""
    name, digest = rendered["metadata"]["name"], rendered["metadata"]["labels"][render_cache.FILL_LABEL]
    foreign = current is not None and not owner.owns(current)
    state = render_cache.fill_state(None if foreign else current)
    if state == "Missing" and (filled == digest or migrated):
        state = "Complete"
    return Fill(name, digest, current, rendered, state, render_cache.fill_message(current, name, spec, pods), foreign,
                claim)


def others(cluster: Cluster, owner: render.Owner, fill: Fill) -> list[dict]:
    """This service's fill Jobs for other digests (earlier revisions, claims): once `fill` is done
    they record nothing anyone reads."""
    jobs = cluster.select("Job", owner.namespace, render.labels(owner.name))
    return [j for j in jobs if owner.owns(j) and (j["metadata"].get("labels") or {}).get(render_cache.FILL_LABEL)
            not in (None, fill.digest) and not j["metadata"].get("deletionTimestamp")]
