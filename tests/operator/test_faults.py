"""The operator under API faults: conflicts, server errors, a restart mid-reconcile, an answer that
never ends."""

import asyncio
import json
import signal

import aiohttp.web
import httpx2
import pytest
from lightkube import AsyncClient, KubeConfig

from embedop.kube import Kube, Retryable
from tests.conftest import free_port
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path

NS = "default"


def objects(emulator, name):
    return [emulator.get(path) for path in (
        f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", f"/api/v1/namespaces/{NS}/services/{name}",
        f"/api/v1/namespaces/{NS}/services/{name}-headless", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{name}")]


def count(emulator, collection, name):
    return sum(1 for o in emulator.get(collection)["items"] if o["metadata"]["name"] == name)


def test_api_errors_are_retried_and_never_duplicate_objects(emulator, operator):
    em.faults.update({
        ("POST", "deployments"): [500, 503],  # what does not exist is created
        ("POST", "services"): [409, 500],  # (a 409 is read as someone else's object: read again, there is none)
        ("PATCH", "deployments"): [500],  # the create's fields made our apply's: at the next reconcile, then
        ("POST", "poddisruptionbudgets"): [429],
        ("PATCH", "embeddingservices"): [500],  # the status write, too
        ("GET", "poddisruptionbudgets"): [em.TIMEOUT],  # and a call that times out
    })
    emulator.request("POST", service_path(NS), new_service("flaky", {"model": "m", "resources": {"gpu": 0}}))
    eventually(lambda: all(objects(emulator, "flaky")), timeout=60)
    eventually(lambda: emulator.get(service_path(NS, "flaky")).get("status", {}).get("selector"), timeout=30)
    assert not any(em.faults.values())  # every fault was hit, and got past
    # The create's field ownership became our apply's, though the first attempt failed (500).
    deploy = f"/apis/apps/v1/namespaces/{NS}/deployments/flaky"
    eventually(lambda: [m["operation"] for m in emulator.get(deploy)["metadata"]["managedFields"]
                        if m["manager"] == "embedop"] == ["Apply"])
    assert count(emulator, f"/apis/apps/v1/namespaces/{NS}/deployments", "flaky") == 1
    assert count(emulator, f"/api/v1/namespaces/{NS}/services", "flaky") == 1
    assert "; again in" in operator.log()  # retried, saying so


def test_a_restart_mid_reconcile_converges(emulator, operator, tmp_path):
    # Service creation keeps failing: the reconcile stops half-way (Deployment only) ...
    em.faults[("POST", "services")] = [500] * 1000
    emulator.request("POST", service_path(NS), new_service("halfway", {"model": "m", "resources": {"gpu": 0}}))
    eventually(lambda: objects(emulator, "halfway")[0], timeout=30)
    assert objects(emulator, "halfway")[1] is None
    # ... the operator dies without a goodbye, the API heals, a new operator starts.
    operator.proc.send_signal(signal.SIGKILL)
    operator.proc.wait(10)
    em.faults.clear()
    fresh = OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator2.log")
    try:
        eventually(lambda: all(objects(emulator, "halfway")), timeout=60)
        eventually(lambda: all(objects(emulator, "flaky")), timeout=30)
    finally:
        fresh.stop()


def test_a_429_is_retried_after_the_wait_the_api_server_asks(emulator, tmp_path):
    """API Priority and Fairness answers 429 with Retry-After: trying again sooner only adds to the
    load that caused it. The emulator asks for 8 s, more than the operator's own 5 s back-off."""
    fresh = OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log")
    try:
        em.faults[("POST", "deployments")] = [429]
        emulator.request("POST", service_path(NS), new_service("throttled", {"model": "m", "resources": {"gpu": 0}}))
        eventually(lambda: objects(emulator, "throttled")[0], timeout=30)
        refused = next(c["t"] for c in em.calls if c.get("fault") == 429 and c["resource"] == "deployments")
        retried = next(c["t"] for c in em.calls if c["t"] > refused and c["resource"] == "deployments"
                       and c["verb"] in ("create", "patch"))
        assert retried - refused >= em.RETRY_AFTER_S - 0.5, retried - refused
    finally:
        fresh.stop()


def test_the_wait_after_a_failure_doubles_up_to_the_periodic_check():
    from embedop.fleet import retry_in

    assert [retry_in(n, 5.0, 30.0) for n in range(1, 7)] == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]
    assert retry_in(1, 5.0, 2.0) == 2.0 and retry_in(10_000, 5.0, 30.0) == 30.0


def test_a_failure_that_persists_is_retried_ever_less_often_up_to_the_periodic_check(tmp_path):
    """A service whose every status write fails (503: an outage, a webhook down) used to be retried
    every 5 s for as long as it lasted, a fresh pass each time: 12 a minute per service against a
    periodic check every 30 s. Each failure in a row now waits twice as long, up to the periodic
    check's interval (here 0.25 s doubling to 8 s); watch events (the objects its first pass made)
    do not cut the wait short."""
    resync, first = 8.0, 0.25
    key = ("PATCH", "embeddingservices/status", "backoff")  # this operator's calls alone (its token)
    em.faults[key] = [503] * 1000
    with Emulator() as e:
        op = OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig", token="backoff"), tmp_path / "operator.log",
                             env={"EMBEDOP_RESYNC_SECONDS": str(resync), "EMBEDOP_RETRY_SECONDS": str(first)})
        try:
            e.request("POST", service_path(NS), new_service("outage", {"model": "m", "resources": {"gpu": 0},
                                                                              "autoscaling": {"mode": "off"}}))
            faulted = lambda: [c["t"] for c in em.calls if c.get("fault") == 503 and c["resource"] == "embeddingservices"]  # noqa: E731
            times = eventually(lambda: len(t := faulted()) >= 7 and t, timeout=60)
        finally:
            op.stop()
            em.faults.pop(key, None)
    gaps = [b - a for a, b in zip(times, times[1:])]
    for n, gap in enumerate(gaps[:6], start=1):  # at least 80% of each wait (the random part)
        assert gap >= 0.75 * min(resync, first * 2 ** (n - 1)), (n, gaps)
    assert gaps[5] >= 0.75 * resync, gaps  # at the cap: the periodic check's pace, not every few seconds


async def test_a_call_that_trickles_is_cut_at_the_api_timeout_in_all(tmp_path):
    """An answer that comes a byte at a time, each within the client's timeout per phase, never
    ends: every call is bounded in all by EMBEDOP_API_TIMEOUT_S (the lease's arithmetic assumes a
    write lands within it, or not at all)."""
    async def trickle(request):
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b" ")
                await asyncio.sleep(0.2)
        except ConnectionResetError:  # the client gave up
            return response

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", trickle)
    runner = aiohttp.web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NS}}]}))
    kube = Kube(AsyncClient(config=KubeConfig.from_file(config), timeout=httpx2.Timeout(1.0)), timeout_s=1.0)
    try:
        with pytest.raises(Retryable, match="patch Lease/l: no answer within 1 s"):
            # The guard: without a bound in all, the call would never end.
            await asyncio.wait_for(kube.merge_patch("Lease", NS, "l", {"spec": {}}), 20)
    finally:
        await kube.close()
        await runner.cleanup()
