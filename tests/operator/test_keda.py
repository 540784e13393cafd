"""autoscaling.mode keda through the real operator process and the emulator's API, which serves
KEDA's and its HTTP add-on's CRDs (tests/operator/fixtures) and refuses what their schemas and CEL
rules refuse: the ScaledObject and, at minReplicas 0, the add-on's routes are made, owned, kept
(a hand edit is undone) and deleted when the service stops scaling to zero or leaves mode keda;
the Deployment's spec.replicas is handed over as in mode hpa and never written again while KEDA
(here: the tests, as KEDA and its HPA do, through the scale subresource) moves it, zero included;
Ready is False, ScaledToZero, at zero. An older add-on gets an HTTPScaledObject; a cluster without
KEDA gets a Degraded service naming its CRD, one without the add-on a floor of one pod and a
Degraded naming the add-on's. The steps run in order, on one service. (KEDA itself, and the
garbage collection of what the service owns: tests/cluster/.)"""

import pytest

from embedop import crd, render_keda
from embedop.kube import CALLS
from tests.operator import emulator as em
from tests.operator import keda_schema
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path

NS, NAME = "default", "sleepy"
SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 4, "idleSeconds": 120}}
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
SO = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/{NAME}"
ROUTES = f"/apis/http.keda.sh/v1beta1/namespaces/{NS}/interceptorroutes"
HTTPSOS = f"/apis/http.keda.sh/v1alpha1/namespaces/{NS}/httpscaledobjects"
EVENTS = f"/api/v1/namespaces/{NS}/events"


def conditions(e: Emulator, name: str = NAME) -> dict:
    return {c["type"]: c for c in ((e.get(service_path(NS, name)) or {}).get("status") or {}).get("conditions") or []}


def deployment_applies(since: int, name: str = NAME, manager: str = "embedop") -> list[dict]:
    return [a for a in em.applies[since:] if a["kind"] == "Deployment" and a["name"] == name and a["manager"] == manager]


def checks(op: OperatorProcess, name: str = NAME) -> int:
    return op.log().count(f"{NS}/{name}: periodic check done")


@pytest.fixture(scope="module")
def keda():
    """An API server with KEDA's ScaledObject CRD and both of the add-on's route CRDs."""
    with Emulator(keda=True) as e:
        yield e


@pytest.fixture(scope="module")
def op(keda, tmp_path_factory):
    d = tmp_path_factory.mktemp("keda")
    process = OperatorProcess(keda.kubeconfig(d / "kubeconfig"), d / "operator.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def created(keda, op):
    mark = len(em.applies)
    body = keda.request("POST", service_path(NS), new_service(NAME, SPEC, NS))
    return {"mark": mark, "uid": body["metadata"]["uid"]}


def test_mode_keda_makes_the_scaled_object_and_the_routes_owned_and_valid(keda, op, created):
    so = eventually(lambda: keda.get(SO))
    http = eventually(lambda: keda.get(f"{ROUTES}/{NAME}-http"))
    grpc = eventually(lambda: keda.get(f"{ROUTES}/{NAME}-grpc"))
    for obj in (so, http, grpc):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("EmbeddingService", created["uid"], True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "embedop"
        assert keda_schema.problems(obj) == []
    assert so["spec"]["scaleTargetRef"]["name"] == NAME and so["spec"]["minReplicaCount"] == 0
    assert so["spec"]["cooldownPeriod"] == 120 and so["spec"]["maxReplicaCount"] == 4
    assert [t["metadata"].get("interceptorRoute") for t in so["spec"]["triggers"]] == [None, f"{NAME}-http",
                                                                                      f"{NAME}-grpc"]
    assert keda.get(f"{HTTPSOS}/{NAME}-http") is None  # the InterceptorRoute CRD is there: no HTTPScaledObject
    # The routes were written before the ScaledObject whose triggers name them.
    order = [(a["kind"], a["name"]) for a in em.applies[created["mark"]:] if a["kind"] in render_keda.KINDS]
    assert order.index(("ScaledObject", NAME)) > order.index(("InterceptorRoute", f"{NAME}-grpc"))


def test_the_count_is_handed_over_to_keda_and_never_written_after(keda, op, created):
    """Created with spec.replicas (1), then handed over as in mode hpa (one apply of the count alone
    under the handover manager), then every apply leaves it out; KEDA (its activation, 0 and back)
    and its HPA (the rest) write it through the scale subresource, and it stays as they leave it."""
    eventually(lambda: deployment_applies(created["mark"], manager="embedop-handover"))
    ours = deployment_applies(created["mark"])
    assert ours[0]["body"]["spec"]["replicas"] == 1 and ours[0]["create"]
    eventually(lambda: "embedop" not in keda.k8s.replica_owners[NS, NAME])
    handed = len(em.applies)
    keda.merge_patch(f"{DEPLOY}/scale?fieldManager=keda", {"spec": {"replicas": 0}})  # idle: KEDA scales to zero
    seen = checks(op)
    eventually(lambda: checks(op) >= seen + 3)  # three periodic checks (2 s apart here)
    assert keda.get(DEPLOY)["spec"]["replicas"] == 0
    ready = eventually(lambda: conditions(keda)["Ready"]["reason"] == "ScaledToZero" and conditions(keda)["Ready"])
    assert ready["status"] == "False"
    eventually(lambda: keda.get(service_path(NS, NAME))["spec"].get("replicas") == 0)  # mirrored
    assert keda.get(service_path(NS, NAME))["status"]["desiredReplicas"] == 0
    keda.merge_patch(f"{DEPLOY}/scale?fieldManager=keda", {"spec": {"replicas": 1}})  # woken
    keda.merge_patch(f"{DEPLOY}/scale?fieldManager=kube-controller-manager", {"spec": {"replicas": 3}})  # its HPA
    eventually(lambda: keda.get(service_path(NS, NAME))["status"].get("desiredReplicas") == 3)
    assert conditions(keda)["Ready"]["reason"] != "ScaledToZero"
    seen = checks(op)
    eventually(lambda: checks(op) >= seen + 2)
    assert keda.get(DEPLOY)["spec"]["replicas"] == 3
    assert all("replicas" not in a["body"]["spec"] for a in deployment_applies(handed)), deployment_applies(handed)
    assert not [w for w in em.writes if w[1] == "deployments/scale" and w[0] == "operator" and w[3] == NAME]


def test_kedas_hpa_is_what_status_reports(keda, op, created):
    """KEDA copies the ScaledObject's labels onto its HPA: the operator's watch has it, and its
    wish is status.desiredReplicas (mode hpa's rule)."""
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": render_keda.hpa_name(NAME), "namespace": NS,
                        "labels": keda.get(SO)["metadata"]["labels"]},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                    "minReplicas": 1, "maxReplicas": 4},
           "status": {"currentReplicas": 3, "desiredReplicas": 4}}
    keda.request("POST", f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers", hpa)
    eventually(lambda: keda.get(service_path(NS, NAME))["status"].get("desiredReplicas") == 4)
    assert keda.get(f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{render_keda.hpa_name(NAME)}")


def test_a_hand_edit_of_the_scaled_object_is_undone(keda, op, created):
    keda.merge_patch(SO, {"spec": {"cooldownPeriod": 5}})
    eventually(lambda: keda.get(SO)["spec"]["cooldownPeriod"] == 120)


def test_above_zero_the_routes_go_and_the_floor_is_the_specs(keda, op, created):
    keda.merge_patch(service_path(NS, NAME), {"spec": {"autoscaling": {"minReplicas": 1}}})
    eventually(lambda: keda.get(f"{ROUTES}/{NAME}-http") is None and keda.get(f"{ROUTES}/{NAME}-grpc") is None)
    so = eventually(lambda: (so := keda.get(SO)) and so["spec"]["minReplicaCount"] == 1 and so)
    assert [t["name"] for t in so["spec"]["triggers"]] == ["embedop"]  # the add-on's triggers gone with its routes
    assert {d[1:4] for d in em.deletes} >= {("interceptorroutes", NS, f"{NAME}-http"),
                                           ("interceptorroutes", NS, f"{NAME}-grpc")}


def test_leaving_mode_keda_deletes_the_scaled_object_and_takes_the_count_back(keda, op, created):
    mark = len(em.applies)
    keda.merge_patch(service_path(NS, NAME), {"spec": {"autoscaling": {"mode": "operator"}}})
    eventually(lambda: keda.get(SO) is None)
    assert ("scaledobjects", NS, NAME) in {d[1:4] for d in em.deletes}
    applied = eventually(lambda: [a for a in deployment_applies(mark) if "replicas" in a["body"]["spec"]])
    assert applied[0]["body"]["spec"]["replicas"] == 3  # the count KEDA's HPA left
    calls = em.recorded["operator"]
    used = {c for c in calls if c[0] in ("keda.sh", "http.keda.sh")}
    assert used >= {("keda.sh", "scaledobjects", v) for v in ("list", "watch", "create", "patch", "delete")}
    assert used >= {("http.keda.sh", "interceptorroutes", v) for v in ("list", "watch", "create", "delete")}
    assert calls <= CALLS, calls - CALLS


def degraded(e: Emulator, name: str) -> dict | None:
    c = conditions(e, name).get("Degraded")
    return c if c and c["status"] == "True" else None


def test_an_older_add_on_gets_an_http_scaled_object(tmp_path):
    with Emulator(keda=("scaledobjects", "httpscaledobjects")) as e:
        with OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log").running():
            e.request("POST", service_path(NS), new_service("old-addon", SPEC, NS))
            httpso = eventually(lambda: e.get(f"{HTTPSOS}/old-addon-http"))
            assert httpso["metadata"]["annotations"][render_keda.SKIP_SCALED_OBJECT] == "true"
            assert keda_schema.problems(httpso) == []
            so = eventually(lambda: e.get(f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/old-addon"))
            assert so["spec"]["minReplicaCount"] == 0
            assert so["spec"]["triggers"][1]["metadata"]["httpScaledObject"] == "old-addon-http"
            assert not degraded(e, "old-addon")


def test_without_the_add_on_zero_is_refused_and_said(tmp_path):
    with Emulator(keda=("scaledobjects",)) as e:
        with OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log").running():
            e.request("POST", service_path(NS), new_service("no-addon", SPEC, NS))
            so = eventually(lambda: e.get(f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/no-addon"))
            assert so["spec"]["minReplicaCount"] == 1 and len(so["spec"]["triggers"]) == 1  # nothing could wake it
            condition = eventually(lambda: degraded(e, "no-addon"))
            assert condition["reason"] == render_keda.ADDON_MISSING
            assert render_keda.ROUTE_CRD in condition["message"] and render_keda.HTTPSO_CRD in condition["message"]


def test_without_keda_the_service_is_degraded_naming_it_and_others_are_served(emulator, tmp_path):
    """Most clusters have no KEDA: its kinds' lists are 404, which costs the other services
    nothing; a service in mode keda gets its Deployment and a Degraded condition naming the CRD."""
    with OperatorProcess(emulator.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log").running() as p:
        try:
            emulator.request("POST", service_path(NS), new_service("plain-op", {**SPEC, "autoscaling": {}}, NS))
            emulator.request("POST", service_path(NS), new_service("wants-keda", SPEC, NS))
            eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/wants-keda"))
            condition = eventually(lambda: degraded(emulator, "wants-keda"))
            assert condition["reason"] == render_keda.KEDA_MISSING and render_keda.CRD_NAME in condition["message"]
            events = eventually(lambda: [e for e in emulator.get(EVENTS)["items"]
                                         if e["involvedObject"]["name"] == "wants-keda"
                                         and render_keda.CRD_NAME in e.get("message", "")])
            assert events[0]["type"] == "Warning" and events[0]["reason"] == render_keda.KEDA_MISSING
            eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/plain-op"))
            assert not degraded(emulator, "plain-op")
            assert "ScaledObject is not served by this cluster" in p.log()
            assert "watching ScaledObject" not in p.log()  # no warning-and-backoff loop for an absent CRD
            # Known absent (its list was a 404): not even tried. (The emulator records no call to a
            # resource it does not serve; the operator's log has every request it sent.)
            seen = checks(p, "wants-keda")
            eventually(lambda: checks(p, "wants-keda") >= seen + 2)
            assert "/namespaces/default/scaledobjects" not in p.log()
        finally:
            for name in ("plain-op", "wants-keda"):
                emulator.request("DELETE", service_path(NS, name))


def test_someone_elses_scaled_object_on_the_service_is_said(keda, op):
    """The docs' recipe from before mode keda (a ScaledObject on the EmbeddingService, in mode off)
    fights any other mode: the operator says so, naming it, and leaves it alone (it is not ours)."""
    name, path = "fought", f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects"
    keda.request("POST", service_path(NS), new_service(name, {**SPEC, "autoscaling": {"mode": "keda", "minReplicas": 1}}, NS))
    keda.request("POST", path, {"apiVersion": render_keda.API_VERSION, "kind": "ScaledObject",
                                "metadata": {"name": "by-hand", "namespace": NS},  # as the docs once said
                                "spec": {"scaleTargetRef": {"apiVersion": crd.API_VERSION,
                                                            "kind": "EmbeddingService", "name": name},
                                         "triggers": [{"type": "cpu", "metadata": {"value": "50"}}]}})
    said = eventually(lambda: [e for e in keda.get(EVENTS)["items"] if e["involvedObject"]["name"] == name
                               and e["reason"] == "SpecWarning" and "ScaledObject by-hand" in e.get("message", "")],
                      timeout=60)
    assert "EmbeddingService/fought" in said[0]["message"] and said[0]["type"] == "Warning"
    assert keda.get(f"{path}/by-hand") is not None  # not ours: left as it is
    keda.request("DELETE", f"{path}/by-hand")
    keda.request("DELETE", service_path(NS, name))
