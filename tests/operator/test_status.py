"""The reconcile and the autoscaler both write the Deployment's count and the service's status,
each only with the resourceVersion it read: a write computed from a stale read is refused (409)
and recomputed, so neither undoes the other. For status, each has its own fields; raced from the
same stale read, the conditions never flap. (The emulator answers 409 for a stale resourceVersion as the API
server does; it does not implement the conditions list's merge keys, nor is it needed here: the
writers merge-patch the whole list they computed from a fresh read.)"""

import asyncio

import pytest
from lightkube import AsyncClient, KubeConfig

from embedop import autoscale, autoscaler, reconcile, spec as specs
from embedop.config import OperatorSettings
from embedop.kube import Conflict, Kube
from tests.operator import emulator as em
from tests.operator.emulator import new_service, service_path

NS, NAME = "default", "racy"


@pytest.fixture
async def kube(emulator, tmp_path):
    k = Kube(AsyncClient(config=KubeConfig.from_file(emulator.kubeconfig(tmp_path / "kubeconfig"))))
    yield k
    await k.close()


def decision(limited: bool) -> autoscale.Decision:
    return autoscale.Decision(desired=3, reason="steady", recommendation=9 if limited else 3, capacity=1200.0,
                              demand=0.0, forecast=0.0, limited=limited, history=autoscale.History())


async def test_the_reconcile_and_the_autoscaler_racing_keep_each_others_conditions(emulator, kube):
    emulator.request("POST", service_path(NS), new_service(NAME, {"model": "m", "autoscaling": {"maxReplicas": 4}}))
    spec = specs.defaulted({"model": "m", "autoscaling": {"maxReplicas": 4}})
    deployment = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}}
    conflicts_before = len(em.conflicts)
    for round_ in range(6):
        limited, problems = round_ % 2 == 0, (["made up"] if round_ % 2 else [])  # both change
        stale = await kube.get("EmbeddingService", NS, NAME)  # both writers start from this read
        await asyncio.gather(
            reconcile._write_status(kube, stale, spec, deployment, None, reconcile.Outcome(problems, [], body=stale)),
            autoscaler._write_status(kube, NS, NAME, spec, decision(limited), [], 3, body=stale),
        )
        st = emulator.get(service_path(NS, NAME))["status"]
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert conditions == {"Ready": "False" if problems else "True", "Progressing": "False",
                              "Degraded": "True" if problems else "False",
                              "ScalingLimited": "True" if limited else "False",
                              "MetricsUnavailable": "False"}, (round_, st["conditions"])
        assert st["desiredReplicas"] == 3 and st["serviceRateTokensPerSecond"] == 1200.0 and st["replicas"] == 3
    # Each round one writer found the other had written since its read, and recomputed.
    assert len(em.conflicts) - conflicts_before >= 6


async def test_a_stale_count_is_refused_in_both_directions(emulator, kube):
    emulator.request("POST", service_path(NS), new_service("counted", {"model": "m", "resources": {"gpu": 0}}))
    body = await kube.get("EmbeddingService", NS, "counted")
    spec, settings = specs.defaulted(body["spec"]), OperatorSettings()
    await kube.apply(reconcile.deployment_for(settings, body, spec, None, 2)[0])
    stale = await kube.get("Deployment", NS, "counted")
    # The autoscaler applies its decision (4) after the reconcile read the count (2) ...
    assert await autoscaler._scale(kube, settings, body, spec, stale, 4)
    # ... so the reconcile's apply, computed from its read, is refused rather than undoing it.
    with pytest.raises(Conflict):
        await kube.apply(reconcile.deployment_for(settings, body, spec, stale)[0])
    assert (await kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 4
    # And a decision taken on a count that changed meanwhile (kubectl scale) is dropped.
    decided_on = await kube.get("Deployment", NS, "counted")
    emulator.merge_patch(f"/apis/apps/v1/namespaces/{NS}/deployments/counted/scale?fieldManager=kubectl",
                         {"spec": {"replicas": 3}})
    assert not await autoscaler._scale(kube, settings, body, spec, decided_on, 1)
    assert (await kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 3
    # The reconcile, from a fresh read, keeps the live count.
    await reconcile.reconcile(kube, settings, NS, "counted")
    assert (await kube.get("Deployment", NS, "counted"))["spec"]["replicas"] == 3


def steady_decision(desired=3, capacity=1200.0, offered=500.0) -> autoscale.Decision:
    return autoscale.Decision(desired=desired, reason="steady", recommendation=desired, capacity=capacity, demand=offered,
                              forecast=offered, limited=False, history=autoscale.History(), offered=offered)


async def test_an_unchanged_decision_writes_nothing(emulator, kube):
    """The gauges move a little at every scrape: status is written when a measurement moves by more
    than 2% (and 1 unit), or when anything else changes at all."""
    emulator.request("POST", service_path(NS), new_service("quiet", {"model": "m"}))
    spec = specs.defaulted({"model": "m"})

    async def write(d: autoscale.Decision) -> str:
        await autoscaler._write_status(kube, NS, "quiet", spec, d, [], 3)
        return emulator.get(service_path(NS, "quiet"))["metadata"]["resourceVersion"]

    first = await write(steady_decision(capacity=1234.5678, offered=500.0))
    assert await write(steady_decision(capacity=1241.3, offered=507.9)) == first  # within 2%: nothing written
    assert await write(steady_decision(capacity=1234.5678, offered=500.4)) == first
    assert emulator.get(service_path(NS, "quiet"))["status"]["serviceRateTokensPerSecond"] == 1230.0  # 3 digits
    moved = await write(steady_decision(capacity=1300.0, offered=500.0))  # +5%: written
    assert moved != first and emulator.get(service_path(NS, "quiet"))["status"]["serviceRateTokensPerSecond"] == 1300.0
    assert await write(steady_decision(desired=4, capacity=1300.0)) != moved  # the decision: always, exactly


async def test_the_autoscaler_mirrors_its_count_into_spec_replicas(emulator, kube):
    """After a scale, spec.replicas is the new count (through the scale subresource), so that a
    switch to mode off, which applies spec.replicas, keeps the fleet."""
    emulator.request("POST", service_path(NS), new_service("grown", {"model": "m", "resources": {"gpu": 0},
                                                                     "autoscaling": {"maxReplicas": 8}}))
    body = await kube.get("EmbeddingService", NS, "grown")
    spec, settings = specs.defaulted(body["spec"]), OperatorSettings()
    await kube.apply(reconcile.deployment_for(settings, body, spec, None)[0])
    live = await kube.get("Deployment", NS, "grown")
    assert live["spec"]["replicas"] == 1
    assert await autoscaler._scale(kube, settings, body, spec, live, 6)
    cr = emulator.get(service_path(NS, "grown"))
    assert (await kube.get("Deployment", NS, "grown"))["spec"]["replicas"] == 6 and cr["spec"]["replicas"] == 6
    assert ("embedfleet.dev", "embeddingservices/scale", "patch") in em.recorded["operator"]


async def test_a_mirror_raced_by_a_users_patch(emulator, kube):
    """The count is written with the resourceVersion of the service as read. A user's patch in
    between: a switch to off alone still gets the fleet's count; one that sets replicas too keeps
    the user's replicas."""
    for name, patch, kept in (("modeonly", {"autoscaling": {"mode": "off"}}, 5),
                              ("both", {"replicas": 2, "autoscaling": {"mode": "off"}}, 2)):
        emulator.request("POST", service_path(NS), new_service(name, {"model": "m", "replicas": 1, "resources": {"gpu": 0},
                                                                 "autoscaling": {"maxReplicas": 8}}))
        stale = await kube.get("EmbeddingService", NS, name)
        spec, settings = specs.defaulted(stale["spec"]), OperatorSettings()
        await kube.apply(reconcile.deployment_for(settings, stale, spec, None, 5)[0])  # the fleet is at 5
        emulator.merge_patch(service_path(NS, name), {"spec": patch})
        assert await reconcile.mirror_count(kube, stale, 5) == (kept == 5)
        assert emulator.get(service_path(NS, name))["spec"]["replicas"] == kept, name
