"""What the emulator has no controller for: the ReplicaSet honouring the marks the operator writes
before a scale-down (autoscale.removal_marks, written with Cluster.annotate: int32's least
pod-deletion-cost on the pods to go, nothing on the others), so the idlest pods go. A plain
Deployment of three pause containers stands for a fleet; its pods' marks are computed from queues
of 0, 500 and 50 tokens, then it is scaled to 1."""

from __future__ import annotations

import asyncio

from lightkube import AsyncClient

from embedop import autoscale
from embedop.cache import Cluster
from embedop.kube import Kube
from tests.operator.conftest import eventually

LABELS = {"app": "deletion-cost"}


def test_a_scale_down_removes_the_pods_with_the_least_queued_work(emulator, namespace):
    deployments = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    emulator.request("POST", deployments, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "costs", "namespace": namespace},
        "spec": {"replicas": 3, "selector": {"matchLabels": LABELS},
                 "template": {"metadata": {"labels": LABELS},
                              "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]}}}})

    def ready_pods():
        pods = emulator.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3Ddeletion-cost")["items"]
        ready = [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions", []))]
        return ready if len(ready) == 3 else None

    pods = eventually(ready_pods, timeout=120)
    names = [p["metadata"]["name"] for p in pods]
    queued = dict(zip(names, (0.0, 500.0, 50.0)))
    samples = [autoscale.PodSample(n, True, True, 1000.0, 100.0, q) for n, q in queued.items()]
    marks = autoscale.removal_marks(samples, {n: {} for n in names}, removed=2, template_cost=None)
    assert set(marks) == {names[0], names[2]}  # the busiest is left as it is

    async def annotate():
        kube = Kube(AsyncClient(), timeout_s=10)
        try:
            cluster = Cluster(kube, {})
            for name, annotations in marks.items():
                await cluster.annotate("Pod", namespace, name, annotations)
        finally:
            await kube.close()
    asyncio.run(annotate())

    emulator.request("PATCH", f"{deployments}/costs/scale", {"spec": {"replicas": 1}}, "application/merge-patch+json")

    def left():
        pods = emulator.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3Ddeletion-cost")["items"]
        alive = [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]
        return alive if len(alive) == 1 else None

    assert eventually(left, timeout=120) == [names[1]]  # the one with the most queued work
