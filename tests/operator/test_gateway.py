"""spec.routing gateway → an InferencePool (the Gateway API Inference Extension), rendered and
checked against the real CRD's v1 schema (vendored: tests/operator/fixtures), then through the
real operator process and the emulator's API: with the CRD installed the pool is made, owned, kept
and deleted when routing goes back to service; without it (most clusters) every other service is
served as before and the one that asks for a pool is Degraded with a message naming the CRD.
(Garbage collection and a real Gateway: tests/cluster/test_gateway_on_cluster.py.)"""

import asyncio
import copy

import pytest

from embedop import cache, render, render_gateway, spec as specs
from embedop.kube import CALLS, Kube
from tests.operator import emulator as em
from tests.operator import inference_pool_schema as schema
from tests.operator import structural
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path

NS = "default"
OWNER = render.Owner("search", NS, "uid-1")
SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}, "autoscaling": {"mode": "off"},
        "routing": "gateway"}


def pool_of(spec: dict) -> dict:
    (pool,) = [o for o in render.companions(OWNER, specs.defaulted(spec)) if o["kind"] == "InferencePool"]
    return pool


def test_the_pool_validates_against_the_real_crd_and_says_what_the_protocol_asks():
    pool = pool_of(SPEC)
    assert schema.problems(pool) == []
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["metadata"]["name"] == "search" and pool["metadata"]["namespace"] == NS
    (ref,) = pool["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("EmbeddingService", "search", "uid-1", True)
    deployment = render.deployment(OWNER, specs.defaulted(SPEC), "img", 1, 30)
    # The pods' labels: the Deployment's selector, which every pod's template carries.
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # The HTTP API port alone (the Gateway routes HTTP; gRPC's port would be handed HTTP/1.1).
    assert pool["spec"]["targetPorts"] == [{"number": render.HTTP_PORT}]
    ports = {p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert render.HTTP_PORT in ports and render.GRPC_PORT not in {p["number"] for p in pool["spec"]["targetPorts"]}
    # HTTP/1.1 is what the pods speak, and the CRD's default: not sent (v1.0.0's CRD lacks the field).
    assert "appProtocol" not in pool["spec"]
    assert schema.SPEC["properties"]["appProtocol"]["default"] == render_gateway.APP_PROTOCOL == "http"
    assert structural.default(copy.deepcopy(pool), schema.SCHEMA)["spec"]["appProtocol"] == "http"
    assert pool["spec"]["endpointPickerRef"] == {"name": "search-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert "kind" not in pool["spec"]["endpointPickerRef"]  # the CRD's default, Service: port.number required


@pytest.mark.parametrize("crd", [schema.CRD, schema.CRD_V1_0_0], ids=["newest", "v1.0.0"])
@pytest.mark.parametrize("extra", [{}, {"endpointPicker": {"name": "shared-epp", "port": 9100, "failureMode": "FailOpen"}}],
                         ids=["default picker", "picker"])
def test_every_field_sent_is_one_the_crd_keeps(crd, extra):
    """The API server prunes what a CRD's schema lacks: a field sent and pruned would differ from
    what is stored at every check. Nothing the pool sends is pruned by v1.0.0's CRD or the newest."""
    pool = pool_of({**SPEC, **extra})
    assert schema.problems(pool, crd) == []
    assert structural.prune(copy.deepcopy(pool), schema.v1_schema(crd)) == pool


def test_the_endpoint_picker_is_the_specs():
    pool = pool_of({**SPEC, "endpointPicker": {"name": "shared-epp", "port": 9100, "failureMode": "FailOpen"}})
    assert schema.problems(pool) == []
    assert pool["spec"]["endpointPickerRef"] == {"name": "shared-epp", "port": {"number": 9100}, "failureMode": "FailOpen"}


@pytest.mark.parametrize("break_it, found", [
    (lambda p: p["spec"].update(targetPorts=[{"number": 8000 + i} for i in range(9)]), "targetPorts"),
    (lambda p: p["spec"].update(targetPorts=[]), "targetPorts"),
    (lambda p: p["spec"].update(targetPorts=[{"number": 8001}, {"number": 8001}]), "unique"),
    (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required"),
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Retry"), "failureMode"),
    (lambda p: p["spec"].update(appProtocol="grpc"), "appProtocol"),
    (lambda p: p["spec"].pop("selector"), "selector"),
    (lambda p: p["spec"]["endpointPickerRef"].pop("name"), "name"),
], ids=["9 ports", "no port", "a port twice", "picker Service without port", "failureMode", "appProtocol",
        "no selector", "picker without name"])
def test_the_check_refuses_what_the_api_server_would(break_it, found):
    """The validation can fail: each fact the CRD states, broken once."""
    pool = copy.deepcopy(pool_of(SPEC))
    break_it(pool)
    assert any(found in p for p in schema.problems(pool)), schema.problems(pool)


def test_routing_service_renders_no_pool_and_the_kind_is_optional():
    assert not [o for o in render.companions(OWNER, specs.defaulted({**SPEC, "routing": "service"}))
                if o["kind"] == "InferencePool"]
    assert specs.defaulted({"model": "m"})["routing"] == "service"
    assert "InferencePool" in render.OPTIONAL_KINDS  # deleted when the spec stops asking


@pytest.mark.parametrize("extra, said", [
    ({}, []), ({"auth": {"apiKeySecretRef": {"name": "k"}}}, ["metrics port"]),
    ({"networkPolicy": {"enabled": True}}, ["networkPolicy.from"]),
])
def test_what_a_gateway_spec_may_get_wrong_is_warned_not_refused(extra, said):
    spec = specs.defaulted({**SPEC, **extra})
    assert specs.problems(spec) == []
    gateway = [w for w in specs.warnings(spec) if w.startswith("routing gateway")]
    assert len(gateway) == len(said) and all(s in w for s, w in zip(said, gateway))


POOL = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/routed"
EVENTS = f"/api/v1/namespaces/{NS}/events"


@pytest.fixture(scope="module")
def pools():
    """An API server with the InferencePool CRD installed, and an operator."""
    with Emulator(inference_pools=True) as e:
        yield e


@pytest.fixture(scope="module")
def routed(pools, tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway")
    op = OperatorProcess(pools.kubeconfig(d / "kubeconfig"), d / "operator.log")
    created = pools.request("POST", service_path(NS), new_service("routed", SPEC, NS))
    yield created
    op.stop()


def test_routing_gateway_makes_the_pool_owned_and_back_to_service_deletes_it(pools, routed):
    pool = eventually(lambda: pools.get(POOL))
    (ref,) = pool["metadata"]["ownerReferences"]
    assert ref["uid"] == routed["metadata"]["uid"] and ref["controller"] is True
    assert schema.problems(pool) == []
    pools.merge_patch(POOL, {"spec": {"endpointPickerRef": {"failureMode": "FailOpen"}}})  # a hand edit: reverted
    eventually(lambda: pools.get(POOL)["spec"]["endpointPickerRef"]["failureMode"] == "FailClose")
    pools.merge_patch(service_path(NS, "routed"), {"spec": {"routing": "service"}})
    eventually(lambda: pools.get(POOL) is None)
    assert any(d[1:4] == ("inferencepools", NS, "routed") for d in em.deletes)
    assert pools.get(f"/apis/apps/v1/namespaces/{NS}/deployments/routed")  # the rest stays
    pools.merge_patch(service_path(NS, "routed"), {"spec": {"routing": "gateway"}})
    eventually(lambda: pools.get(POOL))
    calls = em.recorded["operator"]
    assert {c for c in calls if c[1] == "inferencepools"} >= {
        ("inference.networking.k8s.io", "inferencepools", v) for v in ("list", "watch", "create", "patch", "delete")}
    assert calls <= CALLS, calls - CALLS


def test_without_the_crd_other_services_are_served_and_the_one_asking_is_degraded(emulator, tmp_path_factory):
    """Most clusters have no InferencePool CRD: its list is a 404, which must cost the other services
    nothing, and a service asking for a pool is told why there is none."""
    d = tmp_path_factory.mktemp("no-gateway-crd")
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log")
    try:
        emulator.request("POST", service_path(NS), new_service("plain", {**SPEC, "routing": "service"}, NS))
        emulator.request("POST", service_path(NS), new_service("wants-pool", SPEC, NS))
        eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/plain"))
        eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/wants-pool"))  # the rest applied

        def degraded():
            conditions = (emulator.get(service_path(NS, "wants-pool")).get("status") or {}).get("conditions") or []
            return [c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"]
        (condition,) = eventually(degraded)
        assert render_gateway.CRD_NAME in condition["message"] and "spec.routing" in condition["message"]
        assert condition["reason"] == render_gateway.CRD_MISSING
        events = eventually(lambda: [e for e in emulator.get(EVENTS)["items"] if e["involvedObject"]["name"] == "wants-pool"
                                     and render_gateway.CRD_NAME in e.get("message", "")])
        assert events[0]["type"] == "Warning"
        plain = (emulator.get(service_path(NS, "plain")).get("status") or {}).get("conditions") or []
        assert not [c for c in plain if c["type"] == "Degraded" and c["status"] == "True"], plain
        assert op.proc.poll() is None  # no crash loop
        assert "InferencePool is not served by this cluster" in op.log()
        assert "watching InferencePool" not in op.log()  # no warning-and-backoff loop for an absent CRD
    finally:
        for name in ("plain", "wants-pool"):
            emulator.request("DELETE", service_path(NS, name))
        op.stop()


def test_a_crd_installed_later_is_watched_without_a_restart(monkeypatch, tmp_path):
    """The informer of an absent CRD's kind lists again every ABSENT_RECHECK_S (shortened here):
    installed meanwhile, its objects reach the operator's copies, the operator process untouched."""
    monkeypatch.setattr(cache, "ABSENT_RECHECK_S", 0.2)
    owner = render.Owner("late", NS, "0b0c7e8e-0000-4000-8000-00000000000a")
    pool = render.inference_pool(owner, specs.defaulted(SPEC))
    with Emulator() as e:
        monkeypatch.setenv("KUBECONFIG", str(e.kubeconfig(tmp_path / "kubeconfig")))

        async def scenario():
            kube, store, seen = Kube.connect(), cache.Store(), []
            informer = cache.Informer(kube, render_gateway.KIND, [NS], store, lambda kind, event, obj: seen.append(event))
            task = asyncio.create_task(informer.run())
            try:
                await asyncio.wait_for(informer.synced.wait(), 10)
                assert informer.absent is True and store.get(NS, "late") is None
                await asyncio.to_thread(e.install_inference_pools)
                await asyncio.to_thread(e.request, "POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools",
                                        pool)
                for _ in range(200):  # polled as `eventually` does, within 10 s
                    if store.get(NS, "late") is not None:
                        break
                    await asyncio.sleep(0.05)
                assert store.get(NS, "late") is not None and informer.absent is False
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await kube.close()

        asyncio.run(scenario())


def test_with_the_v1_0_0_crd_the_pool_is_made_once_and_left_alone(tmp_path):
    """v1.0.0's CRD serves the same inference.networking.k8s.io/v1 without appProtocol: the API
    server prunes a field its schema lacks, so a render that sent it would differ from what is
    stored at every check and be applied again and again. The pool is created once and, check
    after check, not written again; the service is not Degraded."""
    with Emulator(inference_pools=schema.CRD_FILE_V1_0_0) as e:
        op = OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log")
        try:
            e.request("POST", service_path(NS), new_service("old-crd", SPEC, NS))
            path = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/old-crd"
            pool = eventually(lambda: e.get(path))
            assert "appProtocol" not in pool["spec"]
            assert pool["spec"]["endpointPickerRef"]["kind"] == "Service"  # the schema's default, stored
            checks = lambda: op.log().count(f"{NS}/old-crd: periodic check done")  # noqa: E731
            seen = checks()
            eventually(lambda: checks() >= seen + 4)  # 2 s apart here
            writes = [w for w in em.writes if w[1] == "inferencepools" and w[3] in ("old-crd", None)]
            made = [a["create"] for a in em.applies if (a["kind"], a["name"]) == ("InferencePool", "old-crd")]
            assert made == [True], writes  # created, and never applied since
            said = [c for c in (e.get(service_path(NS, "old-crd")).get("status") or {}).get("conditions", [])
                    if c["type"] in ("Degraded", "FieldNotPersisted")]
            assert len(said) == 2 and all(c["status"] == "False" for c in said), said
        finally:
            op.stop()


def test_the_emulator_prunes_what_the_served_crd_lacks():
    """The premise of the test above, as the emulator plays it (a real API server:
    tests/cluster/test_write_on_cluster.py): a field v1.0.0's schema lacks is dropped on write."""
    pool = pool_of(SPEC)
    pool["spec"]["appProtocol"] = "http"
    with Emulator(inference_pools=schema.CRD_FILE_V1_0_0) as e:
        stored = e.request("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", pool)
        assert "appProtocol" not in stored["spec"] and stored["spec"]["selector"] == pool["spec"]["selector"]
    with Emulator(inference_pools=True) as e:
        stored = e.request("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", pool)
        assert stored["spec"]["appProtocol"] == "http"
