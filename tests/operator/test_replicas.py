"""The replica count is never lost: asserted on the applied objects (every server-side apply the
operator sends, with its field manager) and on the live count, through a spec edit, an operator
restart and every mode switch.

The emulator implements, of server-side apply's field ownership, spec.replicas of Deployments
(tests/operator/emulator.py): a count its only manager stops sending is removed and defaults to 1
— what collapsed fleets to one pod. It lacks every other part of field ownership, garbage
collection and controllers: tests/cluster/test_replicas_on_cluster.py runs these steps on a real
API server. The steps run in order, on one service.

In modes operator and hpa the service's spec.replicas mirrors the live count (written through its
scale subresource), so that a switch to mode off, which applies spec.replicas, keeps the fleet. The
emulator patches the whole object for a scale subresource (a real API server converts the service
to a Scale and back); the operator sends only spec.replicas there, so the effect is the same."""

import pytest

from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS, NAME = "default", "fleet"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
HPA = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{NAME}"


def live(emulator) -> int:
    return emulator.get(DEPLOY)["spec"]["replicas"]


def spec_replicas(emulator) -> int:
    return emulator.get(service_path(NS, NAME))["spec"].get("replicas")


def deployment_applies(emulator, since: int, manager: str = "embedop", name: str = NAME) -> list[dict]:
    return [a for a in em.applies[since:] if a["subject"] == emulator.subject and a["kind"] == "Deployment"
            and a["name"] == name and a["manager"] == manager]


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
    eventually(lambda: spec_replicas(emulator) == 3)  # which the service's spec.replicas then shows


def test_a_spec_edit_keeps_the_live_count(emulator, fleet):
    # The count moves outside the operator (kubectl scale deployment): the operator adopts it.
    emulator.merge_patch(f"{DEPLOY}/scale?fieldManager=kubectl", {"spec": {"replicas": 5}})
    mark = edit(emulator, {"model": "m2", "autoscaling": {"minReplicas": 1}})
    applies = settled(emulator, mark, 5)
    assert applies[-1]["force"]  # (an apply of the value in place shares the field with kubectl)
    assert "embedop" in emulator.k8s.replica_owners[NS, NAME]
    eventually(lambda: spec_replicas(emulator) == 5)


def test_an_operator_restart_keeps_the_live_count(emulator, fleet):
    fleet["op"].stop()
    mark = edit(emulator, {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]})  # edited while it is down
    d = fleet["dir"]
    fleet["op"] = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator2.log")
    settled(emulator, mark, 5)


def switch_to_hpa(emulator) -> int:
    """Switch the mode alone to hpa, and wait until the HPA is there; → the mark of the applies."""
    mark = edit(emulator, {"autoscaling": {"mode": "hpa"}})
    settled(emulator, mark, "absent")
    eventually(lambda: emulator.get(HPA))
    return mark


def test_switching_to_hpa_hands_the_count_over(emulator, fleet):
    mark = switch_to_hpa(emulator)
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
    eventually(lambda: spec_replicas(emulator) == 4)  # mirrored into the service


def test_switching_back_to_operator_keeps_the_count_the_hpa_left(emulator, fleet):
    mark = edit(emulator, {"autoscaling": {"mode": "operator"}})
    settled(emulator, mark, 4)  # an apply takes the count back from the HPA's controller
    eventually(lambda: emulator.get(HPA) is None)


def test_switching_to_off_alone_keeps_the_count_and_follows_kubectl_scale(emulator, fleet):
    # The count (4, the HPA's) is not the spec.replicas anyone set (1): the operator has written it
    # there, so a patch of the mode alone keeps the fleet.
    assert spec_replicas(emulator) == 4
    mark = edit(emulator, {"autoscaling": {"mode": "off"}})
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
    eventually(lambda: spec_replicas(emulator) == 2)  # and spec.replicas shows it again
    assert live(emulator) == 2


def test_kubectl_scale_of_the_service_is_undone_in_mode_operator(emulator, fleet):
    """The operator owns the count in mode operator (mode off is for scaling by hand)."""
    mark = len(em.applies)
    emulator.merge_patch(f"{service_path(NS, NAME)}/scale", {"spec": {"replicas": 5}})
    eventually(lambda: spec_replicas(emulator) == 2)
    settled(emulator, mark, 2, must_apply=False)


def test_switching_hpa_to_off_alone_keeps_the_count_the_hpa_set(emulator, fleet):
    switch_to_hpa(emulator)
    emulator.merge_patch(f"{DEPLOY}/scale?fieldManager=kube-controller-manager", {"spec": {"replicas": 6}})
    # The HPA's count, followed on the Deployment's watch event, is written into spec.replicas ...
    eventually(lambda: spec_replicas(emulator) == 6)
    # ... so switching the mode alone keeps it: an apply takes the count back, at 6.
    mark = edit(emulator, {"autoscaling": {"mode": "off"}})
    applies = settled(emulator, mark, 6)
    assert applies and "embedop" in emulator.k8s.replica_owners[NS, NAME]
    eventually(lambda: emulator.get(HPA) is None)


def test_setting_off_and_replicas_together_takes_the_replicas(emulator, fleet):
    mark = edit(emulator, {"autoscaling": {"mode": "operator"}})
    settled(emulator, mark, 6, must_apply=False)
    mark = edit(emulator, {"replicas": 3, "autoscaling": {"mode": "off"}})
    settled(emulator, mark, 3)
    assert spec_replicas(emulator) == 3


def test_the_count_written_into_the_service_does_not_loop(emulator, fleet):
    """Writing spec.replicas comes back as an update of the service: that reconcile, and every
    later one, finds the count in place. With nothing changing, nothing is written again: not
    spec.replicas, not status (not even the autoscaler's measurements), not an owned object (every
    field we send compares equal to what the API stored): none through two periodic checks and two
    autoscaler decisions, as the operator's log counts them."""
    mark = edit(emulator, {"autoscaling": {"mode": "operator"}})
    settled(emulator, mark, 3, must_apply=False)

    def caught_up():  # both status writers have seen the latest generation
        cr = emulator.get(service_path(NS, NAME))
        conditions = cr["status"]["conditions"]
        return {c["type"] for c in conditions} >= {"Ready", "ScalingLimited"} and all(
            c.get("observedGeneration") == cr["metadata"]["generation"] for c in conditions)

    eventually(caught_up)
    log, since, written = fleet["op"].log, len(fleet["op"].log()), len(em.writes)
    generation = emulator.get(service_path(NS, NAME))["metadata"]["generation"]
    eventually(lambda: log()[since:].count(f"{NS}/{NAME}: periodic check done") >= 2
               and log()[since:].count(f"autoscale {NAME}:") >= 2, timeout=60)
    ours = [w for w in em.writes[written:] if w[3] == NAME]  # the service, its status, its objects
    assert ours == [] and emulator.get(service_path(NS, NAME))["metadata"]["generation"] == generation
    assert live(emulator) == 3 == spec_replicas(emulator)


def test_a_service_created_in_mode_hpa_starts_with_its_replicas(emulator, fleet):
    """Not at 1 until the HPA acts: created with spec.replicas (within the HPA's bounds), then the
    count is handed over as for a switch to hpa."""
    name, mark = "born-hpa", len(em.applies)
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "replicas": 3, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 6}}))
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    handover = eventually(lambda: deployment_applies(emulator, mark, "embedop-handover", name))
    assert [a["body"]["spec"] for a in handover] == [{"replicas": 3}]
    ours = deployment_applies(emulator, mark, "embedop", name)
    assert ours[0]["body"]["spec"]["replicas"] == 3  # created with the count ...
    eventually(lambda: "embedop" not in emulator.k8s.replica_owners[NS, name])  # ... then released
    assert "replicas" not in deployment_applies(emulator, mark, "embedop", name)[-1]["body"]["spec"]
    assert emulator.get(path)["spec"]["replicas"] == 3
