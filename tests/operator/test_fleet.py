"""The fleet's loops in-process, against the emulated API server: which services get a loop, and
when, as the leader's write permission comes and goes."""

from __future__ import annotations

import asyncio

from embedop import cache, crd
from embedop.cache import Cluster
from embedop.config import OperatorSettings
from embedop.fleet import Fleet
from embedop.kube import Kube
from tests.operator.emulator import new_service, service_path

NS = "default"


def fleet_on(emulator, tmp_path, monkeypatch, may_write: list[bool]) -> Fleet:
    """A fleet on the emulated API server, this pod's write permission `may_write[0]`."""
    monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig(tmp_path / "kubeconfig")))
    stores = {kind: cache.Store() for kind in (*cache.WATCHED, *cache.UNLABELLED, crd.KIND)}
    return Fleet(Cluster(Kube.connect(5.0), stores, lambda: may_write[0]), OperatorSettings(retry_seconds=0.2),
                 on_outcome=lambda _: None, on_decision=lambda *_: None)


async def test_a_service_seen_while_a_renewal_is_late_gets_its_loop(emulator, tmp_path, monkeypatch):
    """The leader's renewal is late (held() false for a moment), a new service is seen then, and the
    renewal lands before the election looks again: the term never saw the lapse, so nothing calls
    lead() again. The service must still get its loop and its Deployment (it once waited for its
    next change: a Deployment never made, in CI)."""
    body = emulator.request("POST", service_path(NS), new_service("late", {
        "model": "m0", "resources": {"gpu": 0}, "autoscaling": {"mode": "off"}}))
    may_write = [True]
    fleet = fleet_on(emulator, tmp_path, monkeypatch, may_write)
    try:
        await fleet.lead()  # the term starts, with no service known yet
        may_write[0] = False  # the renewal is late
        fleet.cluster.stores[crd.KIND].put(body)  # what handlers.service_event does with the watch's event
        fleet.changed(NS, "late", (body["metadata"]["uid"], body["metadata"]["generation"]))
        may_write[0] = True  # it lands; lead() is not called again
        path = f"/apis/apps/v1/namespaces/{NS}/deployments/late"
        for _ in range(300):  # up to 30 s
            if emulator.get(path) is not None:
                break
            await asyncio.sleep(0.1)
        assert emulator.get(path) is not None, "the service seen during the lapse got no loop"
    finally:
        await fleet.close()
        await fleet.cluster.kube.close()


async def test_a_follower_runs_no_loop_and_a_deleted_service_leaves_nothing(emulator, tmp_path, monkeypatch):
    """Seen by a pod that does not lead: no loop (the leader's loops write; a follower's would only
    wait). Its loops start when it leads; a service deleted leaves no loop and no KEDA rebuild
    schedule (one made again under its name would wait up to 5 min for its first request)."""
    may_write = [False]
    fleet = fleet_on(emulator, tmp_path, monkeypatch, may_write)
    try:
        fleet.cluster.stores[crd.KIND].put(new_service("seen", {"model": "m0"}))
        fleet.changed(NS, "seen", ("uid", 1))
        assert not fleet.tasks
        may_write[0] = True  # it took the lease
        await fleet.lead()
        assert set(fleet.tasks) == {(NS, "seen")}
        fleet.cluster.rebuilt[(NS, "seen")] = (0.0, 4)  # KEDA asked to rebuild its HPA four times
        fleet.stop(NS, "seen")  # the service is deleted
        assert not fleet.tasks and (NS, "seen") not in fleet.cluster.rebuilt  # made again: asked at once
        await fleet.close()
        assert not fleet.tasks
    finally:
        await fleet.cluster.kube.close()
