"""The reconcile and the autoscaler both write the Deployment's count and the service's status,
each only with the resourceVersion it read: a write computed from a stale read is refused (409)
and recomputed, so neither undoes the other. For status, each has its own fields; raced from the
same stale read, the conditions never flap. (The emulator answers 409 for a stale resourceVersion as the API
server does; it does not implement the conditions list's merge keys, nor is it needed here: the
writers merge-patch the whole list they computed from a fresh read.)"""

import asyncio

import pytest
from lightkube import AsyncClient, KubeConfig

from embedop import autoscale, autoscaler, reconcile, spec as specs, status
from embedop.cache import Cluster
from embedop.config import OperatorSettings
from embedop.kube import Conflict, Kube
from tests.operator import emulator as em
from tests.operator.emulator import new_service, service_path

NS, NAME = "default", "racy"


@pytest.fixture
async def cluster(emulator, tmp_path):
    """The operator's Cluster without copies: every read goes to the API (the emulator)."""
    k = Kube(AsyncClient(config=KubeConfig.from_file(emulator.kubeconfig(tmp_path / "kubeconfig"))))
    yield Cluster(k, {})
    await k.close()


def decision(limited: bool) -> autoscale.Decision:
    return autoscale.Decision(desired=3, reason="steady", recommendation=9 if limited else 3, capacity=1200.0,
                              demand=0.0, forecast=0.0, limited=limited, history=autoscale.History())


async def test_the_reconcile_and_the_autoscaler_racing_keep_each_others_conditions(emulator, cluster):
    emulator.request("POST", service_path(NS), new_service(NAME, {"model": "m", "autoscaling": {"maxReplicas": 4}}))
    spec = specs.defaulted({"model": "m", "autoscaling": {"maxReplicas": 4}})
    deployment = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}}
    conflicts_before = len(em.conflicts)
    for round_ in range(6):
        limited, problems = round_ % 2 == 0, (["made up"] if round_ % 2 else [])  # both change
        stale = await cluster.kube.get("EmbeddingService", NS, NAME)  # both writers start from this read
        await asyncio.gather(
            reconcile._write_status(cluster, stale, spec, deployment, None, reconcile.Outcome(problems, [], body=stale),
                                    stale["metadata"]["generation"]),
            autoscaler._write_status(cluster, NS, NAME, spec, decision(limited), [], 3, body=stale),
        )
        st = emulator.get(service_path(NS, NAME))["status"]
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert conditions == {"Ready": "False" if problems else "True", "Progressing": "False",
                              "Degraded": "True" if problems else "False", "FieldNotPersisted": "False",
                              "ScalingLimited": "True" if limited else "False",
                              "MetricsUnavailable": "False"}, (round_, st["conditions"])
        assert st["desiredReplicas"] == 3 and st["serviceRateTokensPerSecond"] == 1200.0 and st["replicas"] == 3
    # Each round one writer found the other had written since its read, and recomputed.
    assert len(em.conflicts) - conflicts_before >= 6


async def test_a_stale_count_is_refused_in_both_directions(emulator, cluster):
    emulator.request("POST", service_path(NS), new_service("counted", {"model": "m", "resources": {"gpu": 0}}))
    body = await cluster.kube.get("EmbeddingService", NS, "counted")
    spec, settings = specs.defaulted(body["spec"]), OperatorSettings()
    await cluster.kube.apply(reconcile.deployment_for(settings, body, spec, None, 2)[0])
    stale = await cluster.kube.get("Deployment", NS, "counted")
    # The autoscaler applies its decision (4) after the reconcile read the count (2) ...
    assert (await autoscaler._scale(cluster, settings, body, spec, stale, 4))[0]
    # ... so the reconcile's apply, computed from its read, is refused rather than undoing it.
    with pytest.raises(Conflict):
        await cluster.kube.apply(reconcile.deployment_for(settings, body, spec, stale)[0])
    assert (await cluster.kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 4
    # And a decision taken on a count that changed meanwhile (kubectl scale) is dropped.
    decided_on = await cluster.kube.get("Deployment", NS, "counted")
    emulator.merge_patch(f"/apis/apps/v1/namespaces/{NS}/deployments/counted/scale?fieldManager=kubectl",
                         {"spec": {"replicas": 3}})
    assert not (await autoscaler._scale(cluster, settings, body, spec, decided_on, 1))[0]
    assert (await cluster.kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 3
    # The reconcile, from a fresh read, keeps the live count.
    await reconcile.reconcile(cluster, settings, NS, "counted")
    assert (await cluster.kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 3


def steady_decision(desired=3, capacity=1200.0, offered=500.0) -> autoscale.Decision:
    return autoscale.Decision(desired=desired, reason="steady", recommendation=desired, capacity=capacity, demand=offered,
                              forecast=offered, limited=False, history=autoscale.History(), offered=offered)


async def test_an_unchanged_decision_writes_nothing(emulator, cluster):
    """The gauges move a little at every scrape: status is written when a measurement moves by more
    than 2% (and 1 unit), or when anything else changes at all."""
    emulator.request("POST", service_path(NS), new_service("quiet", {"model": "m"}))
    spec = specs.defaulted({"model": "m"})

    async def write(d: autoscale.Decision) -> str:
        await autoscaler._write_status(cluster, NS, "quiet", spec, d, [], 3)
        return emulator.get(service_path(NS, "quiet"))["metadata"]["resourceVersion"]

    first = await write(steady_decision(capacity=1234.5678, offered=500.0))
    assert await write(steady_decision(capacity=1241.3, offered=507.9)) == first  # within 2%: nothing written
    assert await write(steady_decision(capacity=1234.5678, offered=500.4)) == first
    assert emulator.get(service_path(NS, "quiet"))["status"]["serviceRateTokensPerSecond"] == 1230.0  # 3 digits
    moved = await write(steady_decision(capacity=1300.0, offered=500.0))  # +5%: written
    assert moved != first and emulator.get(service_path(NS, "quiet"))["status"]["serviceRateTokensPerSecond"] == 1300.0
    assert await write(steady_decision(desired=4, capacity=1300.0)) != moved  # the decision: always, exactly


async def test_measurements_are_refreshed_at_most_when_due(emulator, cluster):
    """A settled service writes nothing between refreshes (status.MEASURED_REFRESH_S), however the
    gauges move; a changed decision or condition takes the measurements along at once."""
    emulator.request("POST", service_path(NS), new_service("calm", {"model": "m"}))
    spec = specs.defaulted({"model": "m"})

    async def write(d: autoscale.Decision, due: bool) -> dict:
        await autoscaler._write_status(cluster, NS, "calm", spec, d, [], 3, due=due)
        return emulator.get(service_path(NS, "calm"))

    first = await write(steady_decision(capacity=1000.0), due=True)
    moved = await write(steady_decision(capacity=1500.0), due=False)  # +50%, not due: nothing
    assert moved["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert (await write(steady_decision(capacity=1500.0), due=True))["status"]["serviceRateTokensPerSecond"] == 1500.0
    changed = await write(steady_decision(desired=4, capacity=2000.0), due=False)
    assert changed["status"]["serviceRateTokensPerSecond"] == 2000.0 and changed["status"]["desiredReplicas"] == 4


async def test_the_autoscaler_mirrors_its_count_into_spec_replicas(emulator, cluster):
    """After a scale, spec.replicas is the new count (through the scale subresource), so that a
    switch to mode off, which applies spec.replicas, keeps the fleet."""
    emulator.request("POST", service_path(NS), new_service("grown", {"model": "m", "resources": {"gpu": 0},
                                                                     "autoscaling": {"maxReplicas": 8}}))
    body = await cluster.kube.get("EmbeddingService", NS, "grown")
    spec, settings = specs.defaulted(body["spec"]), OperatorSettings()
    await cluster.kube.apply(reconcile.deployment_for(settings, body, spec, None)[0])
    live = await cluster.kube.get("Deployment", NS, "grown")
    assert live["spec"]["replicas"] == 1
    assert (await autoscaler._scale(cluster, settings, body, spec, live, 6))[0]
    cr = emulator.get(service_path(NS, "grown"))
    assert (await cluster.kube.get("Deployment", NS, "grown"))["spec"]["replicas"] == 6 and cr["spec"]["replicas"] == 6
    assert ("embedfleet.dev", "embeddingservices/scale", "patch") in em.recorded["operator"]


async def test_a_mirror_raced_by_a_users_patch(emulator, cluster):
    """The count is written with the resourceVersion of the service as read. A user's patch in
    between: a switch to off alone still gets the fleet's count; one that sets replicas too keeps
    the user's replicas."""
    for name, patch, kept in (("modeonly", {"autoscaling": {"mode": "off"}}, 5),
                              ("both", {"replicas": 2, "autoscaling": {"mode": "off"}}, 2)):
        emulator.request("POST", service_path(NS), new_service(name, {"model": "m", "replicas": 1, "resources": {"gpu": 0},
                                                                 "autoscaling": {"maxReplicas": 8}}))
        stale = await cluster.kube.get("EmbeddingService", NS, name)
        spec, settings = specs.defaulted(stale["spec"]), OperatorSettings()
        await cluster.kube.apply(reconcile.deployment_for(settings, stale, spec, None, 5)[0])  # the fleet is at 5
        emulator.merge_patch(service_path(NS, name), {"spec": patch})
        assert await reconcile.mirror_count(cluster, stale, 5) == (kept == 5)
        assert emulator.get(service_path(NS, name))["spec"]["replicas"] == kept, name


def test_observed_generation_is_the_one_acted_on():
    """A user's edit that lands while a reconcile runs has not been acted on (kstatus, Argo CD and
    Flux read observedGeneration as "the controller has seen this spec"); our own mirror of the
    count has."""
    spec = specs.defaulted({"model": "m"})
    mirrored = {"metadata": {"generation": 3}, "spec": {"model": "m", "replicas": 4}}
    edited = {"metadata": {"generation": 3}, "spec": {"model": "other", "replicas": 4}}
    assert reconcile.observed(mirrored, spec, 2) == 3
    assert reconcile.observed(edited, spec, 2) == 2


def ready_of(deployment_status: dict, wanted: int, problems=()) -> dict:
    deployment = {"spec": {"replicas": wanted}, "status": deployment_status}
    out = status.from_deployment(deployment, wanted, list(problems), 1, [], now="2026-01-01T00:00:00Z")
    return next(c for c in out["conditions"] if c["type"] == "Ready")


def test_a_service_stopped_on_purpose_is_ready_scaled_to_zero():
    """Mode off at replicas 0 is what was asked: Ready=True, reason ScaledToZero (as a Deployment at
    0 is Available and a Knative or KEDA service scaled to zero is Ready), once no pod is left; a
    service that wants pods and has none ready is still not Ready."""
    stopped = ready_of({"replicas": 0, "readyReplicas": 0}, wanted=0)
    assert (stopped["status"], stopped["reason"]) == ("True", status.SCALED_TO_ZERO)
    draining = ready_of({"replicas": 1, "readyReplicas": 1}, wanted=0)  # the last pod is still there
    assert (draining["status"], draining["reason"]) == ("False", "ReplicasNotReady")
    waiting = ready_of({"replicas": 1, "readyReplicas": 0}, wanted=1)
    assert (waiting["status"], waiting["reason"]) == ("False", "ReplicasNotReady")
    broken = ready_of({"replicas": 0}, wanted=0, problems=["batching.buckets must be ascending"])
    assert broken["status"] == "False"
    assert ready_of({"replicas": 2, "readyReplicas": 2}, wanted=2)["reason"] == "ReplicasReady"
