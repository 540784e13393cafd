"""One reconcile of an EmbeddingService: render what it owns, apply what drifted, report status.
Plain async functions over the operator's Cluster (cache.py: reads from the watches' copies,
writes to the API); the kopf handlers and the service loops call them.

Every write is guarded by the resourceVersion of what it was computed from. The Deployment is
read first and the service after it, so whatever an apply carries comes from a spec at least as new
as the one behind the Deployment it replaces: the autoscaler (which applies the same render with
its count) and the reconcile cannot undo each other, and a stale count or spec fails with Conflict
and is recomputed from fresh reads. (Kubernetes' documentation advises controllers against a
resourceVersion in an apply because the object's status moves it often; only the Deployment's
apply carries one, for the count's sake, and a conflict costs a re-read.)

Drift is judged against what the API server stores, not what we send (drift.py). An object of an owned kind
and name that this service does not own (someone else's Service, PDB, HPA or Deployment) is never
applied over: SSA would take it over, rewrite its selector and have it garbage-collected with the
service. It is reported instead (Degraded, reason NotOwned). An object that does not exist is created,
not applied, so one someone else makes meanwhile is not taken over either; a render whose fields the
API server does not store as sent is held rather than applied at every check (write.py)."""

from __future__ import annotations

import asyncio
import logging
import dataclasses
from typing import Awaitable, Callable

from embedop import crd, drift, fill as fills, render, render_cache, render_gateway, render_models, render_network, spec as specs, status
from embedop import reconcile_keda, render_keda, write
from embedop.cache import Cluster
from embedop.config import OperatorSettings
from embedop.kube import FIELD_MANAGER, HANDOVER_MANAGER, Conflict, NotFound, Rejected, Retryable

log = logging.getLogger(__name__)

CONFLICT_RETRIES = 5


@dataclasses.dataclass
class Outcome:
    problems: list[str]
    applied: list[str]  # "Kind/name" of objects created or changed
    rejected: str | None = None  # the API's message when it refused an object
    missing: str | None = None  # a kind the spec asks for that the cluster does not serve (its CRD): lack()
    missing_reason: str | None = None  # the Degraded reason (and the Event's) of the first one missing
    notice: str | None = None  # e.g. a newer default image that this service does not get
    gone: bool = False  # the service no longer exists or is being deleted
    body: dict | None = None  # the service as read
    foreign: list[str] = dataclasses.field(default_factory=list)  # "Kind/name" taken by someone else
    warnings: list[str] = dataclasses.field(default_factory=list)  # spec.warnings: said, never refused
    scaled: str | None = None  # the count changed through the scale subresource (the apply was refused)
    fill: fills.Fill | None = None  # a pre-filled model cache's fill (holds: the pods wait for it)
    unpersisted: list[str] = dataclasses.field(default_factory=list)  # renders held: write.held's messages
    claim: dict | None = None  # spec.modelCache.claimName's claim, as watched (None: none, or not there)
    misfit: str | None = None  # a pod's termination message: its models do not fit its device (status.misfit)

    def lack(self, reason: str, message: str) -> None:
        """A kind the spec asks for that the cluster does not serve (or a part of what it asks for
        that the cluster's controllers left out: KEDA's HPA without our metric): Degraded with the
        first one's reason, every message said."""
        self.missing = f"{self.missing}; {message}" if self.missing else message
        self.missing_reason = self.missing_reason or reason


def owner_of(body: dict) -> render.Owner:
    meta = body["metadata"]
    return render.Owner(meta["name"], meta["namespace"], meta.get("uid", ""))


def owned_by(obj: dict, owner: render.Owner) -> bool:
    return owner.owns(obj)


def not_ours(obj: dict | None, owner: render.Owner) -> bool:
    return obj is not None and not owned_by(obj, owner)


def _alive(body: dict | None) -> bool:
    return body is not None and not body["metadata"].get("deletionTimestamp")


def owns_replicas(deployment: dict, manager: str = FIELD_MANAGER) -> bool:
    """Whether `manager` holds spec.replicas by apply (from the Deployment's managedFields)."""
    return any(m.get("manager") == manager and m.get("operation") == "Apply"
               and "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
               for m in (deployment.get("metadata") or {}).get("managedFields") or [])


async def hand_over_replicas(cluster: Cluster, live: dict) -> dict:
    """Before our first apply without spec.replicas (mode hpa): a one-off apply of only the live
    count under a second manager, so the field keeps an owner and its value until the
    HorizontalPodAutoscaler writes it (it then owns it alone). A conflict means the HPA already
    owns the count: nothing to hand over. → the Deployment as it is now."""
    meta = live["metadata"]
    body = {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": live["spec"]["replicas"]}}
    try:
        return await cluster.apply(body, manager=HANDOVER_MANAGER, force=False)
    except Conflict:
        return live


def deployment_for(settings: OperatorSettings, body: dict, spec: dict, live: dict | None,
                   decision: int | None = None) -> tuple[dict, str | None]:
    """The Deployment as it must be applied now: the spec's render, the count as
    render.deployment_replicas says (from the live Deployment, or the autoscaler's `decision`),
    guarded by the live resourceVersion. → (body, image notice)."""
    live_count = live["spec"].get("replicas") if live else (body.get("status") or {}).get("desiredReplicas")
    image, notice = render.server_image(spec, live, settings.server_image, (body.get("status") or {}).get("defaultImage"))
    replicas = render.deployment_replicas(spec, live_count, decision, exists=live is not None)
    obj = drift.stamped(render.deployment(owner_of(body), spec, image, replicas, settings.grace_seconds, settings.metrics_port))
    if live is not None:
        obj["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    return obj, notice


async def apply_deployment(cluster: Cluster, deployment: dict, live: dict | None, hold: bool = False) -> str | None:
    """Apply the Deployment (create it when `live` is None: write.put). When admission refuses
    the whole spec (a Kyverno or Gatekeeper policy, a quota) and only the count had to change, the
    count changes anyway, through the scale subresource: scaling must not stop because of an
    unrelated rule. → the refusal's message when that fallback was taken; Rejected when the count
    could not change either. `hold`: the pod template waits (a model cache's fill, fill.py): only
    the count changes, through the scale subresource, and a Deployment that does not exist yet is
    not created."""
    if hold:
        count = deployment["spec"].get("replicas")
        if live is not None and count is not None and count != live["spec"].get("replicas"):
            meta = live["metadata"]
            await cluster.scale_deployment(meta["namespace"], meta["name"], count, meta["resourceVersion"])
        return None
    try:
        await write.put(cluster, deployment, live)
        return None
    except Rejected as e:
        count = deployment["spec"].get("replicas")
        if live is None or count is None or count == live["spec"].get("replicas") or isinstance(e, NotFound):
            raise
        meta = live["metadata"]
        await cluster.scale_deployment(meta["namespace"], meta["name"], count, meta["resourceVersion"])
        return str(e)


async def mirror_count(cluster: Cluster, body: dict, count: int) -> bool:
    """spec.replicas := `count` (the live Deployment's, render.mirrored_replicas) through the
    service's scale subresource, guarded by the resourceVersion of `body`. On a conflict the
    Deployment and the service are read again, and the live count is written unless spec.replicas
    itself has changed since `body` (a patch that sets mode off and replicas together keeps its
    replicas; one that only switches the mode still gets the fleet's count). The write changes the
    service's spec, so it comes back as an update: that reconcile finds the count in place and
    writes nothing more. → whether it was written."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    seen = (body.get("spec") or {}).get("replicas")
    for _ in range(CONFLICT_RETRIES):
        try:
            await cluster.patch_scale(namespace, name, count, body["metadata"]["resourceVersion"])
            return True
        except NotFound:
            return False
        except Conflict:
            live = await cluster.get("Deployment", namespace, name, fresh=True)
            body = await cluster.get(crd.KIND, namespace, name, fresh=True)
            if not _alive(body) or live is None or (body.get("spec") or {}).get("replicas") != seen:
                return False
            count = live["spec"].get("replicas")
            if count is None or count == seen:
                return False
    raise Retryable(f"spec.replicas of {namespace}/{name}: still conflicting after {CONFLICT_RETRIES} attempts")


async def retry_conflicts(attempt: Callable[[bool], Awaitable]):
    """Run `attempt(fresh)` (which reads and writes guarded) again while it meets a Conflict,
    reading fresh from the API after the first: the watches' copies may lag our own writes."""
    for i in range(CONFLICT_RETRIES):
        try:
            return await attempt(i > 0)
        except Conflict:
            await asyncio.sleep(0.05 * (i + 1))
    raise Retryable(f"still conflicting after {CONFLICT_RETRIES} attempts")


async def reconcile(cluster: Cluster, settings: OperatorSettings, namespace: str, name: str) -> Outcome:
    """Bring the owned objects to the spec (only those that differ are written) and the status
    to what is observed. An unworkable spec writes nothing but a Degraded status."""
    return await retry_conflicts(lambda fresh: _reconcile_once(cluster, settings, namespace, name, fresh))


async def _reconcile_once(cluster: Cluster, settings: OperatorSettings, namespace: str, name: str,
                          fresh: bool) -> Outcome:
    live = await cluster.get("Deployment", namespace, name, fresh)  # first: see the module's docstring
    body = await cluster.get(crd.KIND, namespace, name, fresh)
    if not _alive(body):  # deleted: the garbage collector removes what it owned
        return Outcome([], [], gone=True, body=body)
    owner = owner_of(body)
    spec = specs.defaulted(body.get("spec") or {})
    problems = specs.problems(spec, name)
    outcome = Outcome(problems, [], body=body, warnings=specs.warnings(spec) + render_keda.fighting(
        cluster.select(render_keda.KIND, namespace, {}), owner.owns, name, spec["autoscaling"]["mode"]))
    if render_cache.kind(spec["modelCache"]) in ("claim", "prefilled"):  # its access modes, for status
        try:
            outcome.claim = await cluster.get("PersistentVolumeClaim", namespace, spec["modelCache"]["claimName"], ours=True)
        except Rejected as e:  # not listed yet, and not to be read (RBAC): said, as any refusal
            outcome.rejected = str(e)
    hpa = None
    if not_ours(live, owner):
        outcome.foreign.append(f"Deployment/{name}")
        live = None  # not ours to scale, mirror or report on
    elif not problems:
        try:
            hpa = await _apply_owned(cluster, settings, body, spec, live, outcome)
        except Rejected as e:
            outcome.rejected = str(e)
        if outcome.applied or outcome.scaled:  # an apply's answer is in the copies; a scale's is not
            live = await cluster.get("Deployment", namespace, name, fresh=bool(outcome.scaled))
    # Whatever the spec's problems: the fleet runs at this count, and a switch to off must keep it.
    count = render.mirrored_replicas(spec, live["spec"].get("replicas") if live else None)
    acted_on = body["metadata"].get("generation")  # observedGeneration: the spec this reconcile applied
    if count is not None:
        try:
            if await mirror_count(cluster, body, count):
                outcome.applied.append(f"{crd.KIND}/{name} spec.replicas={count}")
        except Rejected as e:
            outcome.rejected = outcome.rejected or str(e)
        body = await cluster.get(crd.KIND, namespace, name, fresh=True)  # its generation has moved
        if not _alive(body):
            return dataclasses.replace(outcome, gone=True, body=body)
        outcome.body = body
        acted_on = observed(body, spec, acted_on)
    await _write_status(cluster, body, spec, live, hpa, outcome, acted_on)
    return outcome


def observed(fresh: dict, spec: dict, acted_on: int | None) -> int | None:
    """The generation to report as observed by a writer that acted on `spec` at generation
    `acted_on`: `fresh`'s, where only spec.replicas moved since (our own mirror of the count), else
    `acted_on` (a user's edit that landed meanwhile has not been acted on)."""
    def rest(s: dict) -> dict:
        return {k: v for k, v in s.items() if k != "replicas"}
    return fresh["metadata"].get("generation") if rest(specs.defaulted(fresh.get("spec") or {})) == rest(spec) else acted_on


async def _apply_owned(cluster: Cluster, settings: OperatorSettings, body: dict, spec: dict, live: dict | None,
                       outcome: Outcome) -> dict | None:
    """→ the live HorizontalPodAutoscaler (mode hpa; KEDA's in mode keda), for status."""
    owner = owner_of(body)
    live = live and await write.adopted(cluster, "Deployment", live)  # before its resourceVersion guards the apply
    deployment, outcome.notice = deployment_for(settings, body, spec, live)
    hold = await _fill(cluster, settings, body, spec, deployment, outcome)
    # Whether we own the count must match whether we send it: after a mode switch, an apply takes
    # it (from the HPA's controller, kubectl scale, our own scale-subresource fallback) or, in
    # mode hpa, releases it after the handover.
    ownership_differs = live is not None and ("replicas" in deployment["spec"]) != owns_replicas(live)
    if ownership_differs and "replicas" not in deployment["spec"] and not owns_replicas(live, HANDOVER_MANAGER):
        live = await hand_over_replicas(cluster, live)
        deployment["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    if hold:
        await apply_deployment(cluster, deployment, live, hold=True)
    elif (ownership_differs or drift.drifted(deployment, live)) and (stuck := write.held(cluster, deployment, live)):
        outcome.unpersisted.append(stuck)
    elif ownership_differs or drift.drifted(deployment, live):
        try:
            outcome.scaled = await apply_deployment(cluster, deployment, live)
        except Rejected as e:
            outcome.rejected = str(e)
        else:
            if outcome.scaled is None:
                outcome.applied.append(f"Deployment/{owner.name}")
                if stuck := write.held(cluster, deployment, live):  # this apply did not stick, once too often
                    outcome.unpersisted.append(stuck)
            else:
                outcome.rejected = outcome.scaled
    hpa = None
    companions = render.companions(owner, spec, settings.metrics_port, render_network.OperatorPods.of(settings))
    for obj in companions:
        try:
            current = await put_owned(cluster, owner, obj, outcome)
        except NotFound as e:  # the namespace exists (the Deployment is in it): the kind does not
            if obj["kind"] != render_gateway.KIND:
                raise
            outcome.lack(render_gateway.CRD_MISSING, render_gateway.missing_crd_message(str(e)))  # the rest applied
            continue
        if obj["kind"] == "HorizontalPodAutoscaler":
            hpa = current
    # What the spec no longer asks for (mode hpa left, networkPolicy disabled) goes, if it is ours.
    for kind in set(render.OPTIONAL_KINDS) - {obj["kind"] for obj in companions}:
        existing = await cluster.get(kind, owner.namespace, owner.name, ours=True)
        if existing is not None and owned_by(existing, owner):
            await cluster.delete(kind, owner.namespace, owner.name)
            outcome.applied.append(f"-{kind}/{owner.name}")
    deleted, keda_hpa = await reconcile_keda.apply(cluster, settings, owner, spec,
                                                   lambda obj: put_owned(cluster, owner, obj, outcome), outcome.lack)
    outcome.applied.extend(deleted)
    return hpa or keda_hpa


async def put_owned(cluster: Cluster, owner: render.Owner, obj: dict, outcome: Outcome) -> dict | None:
    """Bring one owned object (not the Deployment) to `obj`: created when absent, applied when it
    drifted, held when what we apply does not stick (write.py); someone else's is left alone and
    reported (outcome.foreign). → the live object (None: someone else's); NotFound when the API
    does not serve its kind."""
    obj = drift.stamped(obj)
    current = await cluster.get(obj["kind"], owner.namespace, obj["metadata"]["name"])
    if not_ours(current, owner):
        outcome.foreign.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return None
    current = current and await write.adopted(cluster, obj["kind"], current)
    if drift.drifted(obj, current) and (stuck := write.held(cluster, obj, current)):
        outcome.unpersisted.append(stuck)
    elif drift.drifted(obj, current):
        current, stuck = await write.put(cluster, obj, current)
        outcome.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        outcome.unpersisted.extend([stuck] if stuck else [])
    return current


async def _fill(cluster: Cluster, settings: OperatorSettings, body: dict, spec: dict, deployment: dict,
                outcome: Outcome) -> bool:
    """A pre-filled model cache's Job (fill.ensure). → whether the Deployment waits."""
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    fill, written = await fills.ensure(cluster, settings, owner_of(body), spec, image, body)
    outcome.applied.extend(written)
    if fill is not None and fill.foreign:
        outcome.foreign.append(f"Job/{fill.name}")
    elif fill is not None:
        outcome.fill = fill
    return fill is not None and fill.holds


def desired_replicas(spec: dict, deployment: dict | None, hpa: dict | None) -> int | None:
    """status.desiredReplicas as the reconcile writes it: spec.replicas (off), the HPA's wish or
    the Deployment's count (hpa; keda, with KEDA's HPA, which KEDA itself overrides at zero: the
    Deployment's count then); None in mode operator, where the autoscaler writes it."""
    mode = spec["autoscaling"]["mode"]
    if mode == "off":
        return spec["replicas"]
    if mode == "keda" and ((deployment or {}).get("spec") or {}).get("replicas") == 0:
        return 0
    if mode in render.HANDED_OVER:
        wish = ((hpa or {}).get("status") or {}).get("desiredReplicas")
        return wish if wish is not None else ((deployment or {}).get("spec") or {}).get("replicas")
    return None


async def _write_status(cluster: Cluster, body: dict, spec: dict, deployment: dict | None, hpa: dict | None,
                        outcome: Outcome, generation: int | None) -> None:
    """`generation`: the one this reconcile acted on: a spec edit that lands meanwhile (and makes
    the write below retry on a fresh read) has not been observed."""
    owner = owner_of(body)
    autoscaled = spec["autoscaling"]["mode"] in status.AUTOSCALER_MODES
    pods = cluster.pods(owner.namespace, render.selector(owner.name))
    outcome.misfit = status.misfit(pods, ((deployment or {}).get("spec") or {}).get("template"))

    def compute(fresh: dict) -> dict:
        previous = fresh.get("status") or {}
        wanted = (spec["replicas"] if spec["autoscaling"]["mode"] == "off"
                  else ((deployment or {}).get("spec") or {}).get("replicas"))
        conditions = [c for c in previous.get("conditions") or []
                      if autoscaled or c.get("type") not in status.AUTOSCALER_CONDITIONS]
        new = status.from_deployment(deployment, wanted, outcome.problems, generation, conditions, misfit=outcome.misfit,
                                     rejected=outcome.rejected, foreign=outcome.foreign,
                                     missing=(outcome.missing_reason, outcome.missing) if outcome.missing else None,
                                     zero_is_ready=spec["autoscaling"]["mode"] != "keda",
                                     fill=(outcome.fill.state, outcome.fill.message)
                                     if outcome.fill and outcome.fill.holds else None,
                                     unpersisted=outcome.unpersisted)
        access = render_cache.claim_access(spec, outcome.claim, pods)
        new["conditions"] = [c for c in new["conditions"] if access or c.get("type") != render_cache.SHARED]
        if access:
            new["conditions"] = status.merge_conditions(new["conditions"], [status.condition(
                render_cache.SHARED, *access, generation, previous.get("conditions") or [], status.now_iso())])
        new["selector"], new["modelSummary"] = render.selector_string(owner.name), render_models.summary(spec)
        if (desired := desired_replicas(spec, deployment, hpa)) is not None:
            new["desiredReplicas"] = desired
        if generation is not None:
            new["observedGeneration"] = generation
        if not spec.get("image") and (image := render.pinned_image(deployment)):
            new["defaultImage"] = image  # outlives the Deployment (render.server_image)
        if outcome.fill is not None and outcome.fill.state == "Complete":
            new["modelCache"] = {"filled": outcome.fill.digest}  # fill.py: outlives the Job
        elif not outcome.problems and render_cache.kind(spec["modelCache"]) != "prefilled":
            new["modelCache"] = None
        if not autoscaled:  # the autoscaler's measurements (and served task) would go stale: none is better
            new.update(dict.fromkeys((*status.MEASURED, "task", "models"), None))
        return new

    await update_status(cluster, owner.namespace, owner.name, compute, body)


# Status fields the API server dropped from a write (pruned: the installed CRD predates them).
# Sent again, each write would differ from what is stored, and the operator would write every
# step; so they are sent no more in this process (a restart after the CRD's upgrade sends them).
UNSTORED: set[str] = set()


async def update_status(cluster: Cluster, namespace: str, name: str, compute: Callable[[dict], dict],
                        body: dict | None = None) -> None:
    """Write `compute(service)` to its status when it differs from what is there (a None value:
    the field is removed), guarded by the resourceVersion it was computed from; on Conflict the
    service is read again from the API and the status recomputed. `body`: the read to start from."""
    pending = [body]

    async def attempt(fresh_read: bool):
        fresh = (None if fresh_read else pending.pop() if pending else None) or await cluster.get(
            crd.KIND, namespace, name, fresh=fresh_read)
        new = {k: v for k, v in compute(fresh).items() if k not in UNSTORED} if _alive(fresh) else {}
        if new and status.differs(new, fresh.get("status") or {}, drift.subset):
            try:
                stored = await cluster.patch_status(namespace, name, new, fresh["metadata"]["resourceVersion"])
            except NotFound:  # deleted since it was read: nothing left to report on
                return
            dropped = {k for k, v in new.items() if v is not None and k not in ((stored or {}).get("status") or {})}
            if dropped - UNSTORED:
                log.warning("the API server dropped status fields %s: the installed CRD is older than this "
                            "operator (apply crds/ or upgrade the chart); not sending them again", sorted(dropped))
                UNSTORED.update(dropped)

    await retry_conflicts(attempt)
