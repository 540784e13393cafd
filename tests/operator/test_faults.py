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
from tests.operator.emulator import new_service, service_path

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
