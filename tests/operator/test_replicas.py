"""The replica count is never lost: asserted on the applied objects (every server-side apply the
operator sends, with its field manager) and on the live count, through a spec edit, an operator
restart and every mode switch.

The emulator implements, of server-side apply's field ownership, spec.replicas of Deployments
(tests/operator/emulator.py): a count its only manager stops sending is removed and defaults to 1
— what collapsed fleets to one pod. It lacks every other part of field ownership, garbage
collection and controllers: tests/cluster/test_replicas_on_cluster.py runs these steps on a real
API server. The steps run in order, on one service."""

import pytest

from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS, NAME = "default", "fleet"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
HPA = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{NAME}"


def live(emulator) -> int:
    return emulator.get(DEPLOY)["spec"]["replicas"]


def deployment_applies(emulator, since: int, manager: str = "embedop") -> list[dict]:
    return [a for a in em.applies[since:] if a["subject"] == emulator.subject and a["kind"] == "Deployment"
            and a["name"] == NAME and a["manager"] == manager]


def applied_counts(emulator, since: int) -> list:
    return [a["body"]["spec"].get("replicas", "absent") for a in deployment_applies(emulator, since)]


def edit(emulator, spec: dict) -> int:
    """Change the service's spec; → the index of the applies that follow."""
    mark = len(em.applies)
    emulator.merge_patch(service_path(NS, NAME), {"spec": spec})
    return mark


def settled(emulator, since: int, count, must_apply: bool = True, timeout: float = 30):
    """Wait until the operator has reconciled the service's latest generation (and applied the
    Deployment, when the change needs it) and the live count is `count`; every apply of the
    Deployment since `since` carries `count` ("absent" in mode hpa)."""
    def caught_up():
        cr = emulator.get(service_path(NS, NAME))
        return cr.get("status", {}).get("observedGeneration") == cr["metadata"]["generation"]

    eventually(caught_up, timeout=timeout)
    if must_apply:
        eventually(lambda: deployment_applies(emulator, since), timeout=timeout)
    if count != "absent":
        eventually(lambda: live(emulator) == count, timeout=timeout)
    assert set(applied_counts(emulator, since)) <= {count}, applied_counts(emulator, since)
    return deployment_applies(emulator, since)


@pytest.fixture(scope="module")
def fleet(emulator, tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    state = {"op": OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log"), "dir": d}
    yield state
    state["op"].stop()


def test_the_emulator_removes_a_count_its_only_manager_stops_sending(emulator):
    """The test double's behaviour these tests rely on (so the original bug fails them)."""
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "probe", "namespace": NS},
            "spec": {"replicas": 5, "selector": {"matchLabels": {"a": "b"}},
                     "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/probe?fieldManager=someone&force=true"
    emulator.request("PATCH", path, body, em.APPLY)
    assert emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/probe")["spec"]["replicas"] == 5
    del body["spec"]["replicas"]
    emulator.request("PATCH", path, body, em.APPLY)
    assert emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/probe")["spec"]["replicas"] == 1


def test_mode_operator_applies_the_count_on_create(emulator, fleet):
    mark = len(em.applies)
    emulator.request("POST", service_path(NS), new_service(NAME, {
        "model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 3, "maxReplicas": 6}}))
    settled(emulator, mark, 3)  # spec.replicas (1) clamped to minReplicas


def test_a_spec_edit_keeps_the_live_count(emulator, fleet):
    # The count moves outside the operator (kubectl scale deployment): the operator adopts it.
    emulator.merge_patch(f"{DEPLOY}/scale?fieldManager=kubectl", {"spec": {"replicas": 5}})
    mark = edit(emulator, {"model": "m2", "autoscaling": {"minReplicas": 1}})
    applies = settled(emulator, mark, 5)
    assert applies[-1]["force"]  # (an apply of the value in place shares the field with kubectl)
    assert "embedop" in emulator.k8s.replica_owners[NS, NAME]


def test_an_operator_restart_keeps_the_live_count(emulator, fleet):
    fleet["op"].stop()
    mark = edit(emulator, {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]})  # edited while it is down
    d = fleet["dir"]
    fleet["op"] = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator2.log")
    settled(emulator, mark, 5)


def test_switching_to_hpa_hands_the_count_over(emulator, fleet):
    mark = edit(emulator, {"autoscaling": {"mode": "hpa"}})
    settled(emulator, mark, "absent")
    eventually(lambda: emulator.get(HPA))
    # Before the first apply without the count, a one-off apply of the count alone under another
    # manager keeps it owned (and at 5) until the HPA writes it.
    handover = deployment_applies(emulator, mark, "embedop-handover")
    assert [a["body"]["spec"] for a in handover] == [{"replicas": 5}] and not handover[0]["force"]
    first_without = next(i for i, a in enumerate(em.applies[mark:]) if a["manager"] == "embedop" and a["name"] == NAME)
    assert em.applies[mark:].index(handover[0]) < first_without
    assert live(emulator) == 5 and "embedop" not in emulator.k8s.replica_owners[NS, NAME]
    # The HPA's controller scales through the scale subresource and so takes the field.
    emulator.merge_patch(f"{DEPLOY}/scale?fieldManager=kube-controller-manager", {"spec": {"replicas": 4}})
    assert live(emulator) == 4


def test_switching_back_to_operator_keeps_the_count_the_hpa_left(emulator, fleet):
    mark = edit(emulator, {"autoscaling": {"mode": "operator"}})
    settled(emulator, mark, 4)  # an apply takes the count back from the HPA's controller
    eventually(lambda: emulator.get(HPA) is None)


def test_switching_to_off_applies_spec_replicas_and_follows_kubectl_scale(emulator, fleet):
    mark = edit(emulator, {"replicas": 4, "autoscaling": {"mode": "off"}})
    settled(emulator, mark, 4, must_apply=False)  # nothing to change: the count is already ours
    mark = len(em.applies)
    emulator.merge_patch(f"{service_path(NS, NAME)}/scale", {"spec": {"replicas": 2}})  # kubectl scale embsvc
    settled(emulator, mark, 2)
    eventually(lambda: emulator.get(service_path(NS, NAME))["status"].get("desiredReplicas") == 2)


def test_switching_off_to_operator_keeps_the_count(emulator, fleet):
    mark = edit(emulator, {"autoscaling": {"mode": "operator"}, "replicas": 1})
    settled(emulator, mark, 2, must_apply=False)  # the live count, not spec.replicas
    # The autoscaler has no measurement (no pods here): it holds, and records the count.
    eventually(lambda: emulator.get(service_path(NS, NAME))["status"].get("desiredReplicas") == 2)
    assert live(emulator) == 2
