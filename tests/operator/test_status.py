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
                              "ScalingLimited": "True" if limited else "False"}, (round_, st["conditions"])
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
