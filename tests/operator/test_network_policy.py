"""A service with API keys, TLS and a NetworkPolicy, through the real operator process and the
emulator's API: the Secrets mounted, the probes on the metrics port, the NetworkPolicy owned and
admitting the operator's pods as the operator was told them, kept as rendered, and deleted when
the spec turns it off; mode hpa behind a policy that admits no Prometheus, warned. (What the emulator lacks — garbage collection, the removal of a field an
apply stops sending, a network plugin enforcing the policy — tests/cluster/ judges on a real one.)"""

import pytest

from embedop import spec as specs
from embedop.kube import CALLS
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS = "default"
OPERATOR_NS = "embedfleet-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "embedfleet-operator", "app.kubernetes.io/instance": "ef"}
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/guarded"
SERVICE = f"/api/v1/namespaces/{NS}/services/guarded"
POLICY = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/guarded"
FRONTENDS = [{"podSelector": {"matchLabels": {"app": "search-frontend"}}}]
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}, "autoscaling": {"mode": "off"},
        "auth": {"apiKeySecretRef": {"name": "guarded-keys"}},
        "tls": {"secretRef": {"name": "guarded-tls"}, "clientAuth": True},
        "networkPolicy": {"enabled": True, "from": FRONTENDS, "metricsFrom": PROMETHEUS}}


@pytest.fixture(scope="module")
def guarded(emulator, tmp_path_factory):
    """An operator told its own pods as the chart tells it, and the service."""
    d = tmp_path_factory.mktemp("network-policy")
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log", env={
        "EMBEDOP_POD_NAMESPACE": OPERATOR_NS, "EMBEDOP_POD_LABELS": ",".join(f"{k}={v}" for k, v in OPERATOR_LABELS.items())})
    created = emulator.request("POST", service_path(NS), new_service("guarded", SPEC, NS))
    yield created
    op.stop()


def test_the_service_reconciles_to_secrets_mounted_probes_on_metrics_and_a_policy(emulator, guarded):
    d = eventually(lambda: emulator.get(DEPLOY))
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["API_KEYS_FILE"] == "/etc/embedfleet/auth/api-keys"
    assert env["TLS_CLIENT_CA_FILE"] == "/etc/embedfleet/tls/ca.crt" and env["METRICS_PORT"] == "8002"
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"api-keys": "guarded-keys", "tls": "guarded-tls"}
    assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"] in secrets)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "http": 8001, "metrics": 8002}
    assert {c[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {8002}
    ports = {p["name"]: p for p in eventually(lambda: emulator.get(SERVICE))["spec"]["ports"]}
    assert "appProtocol" not in ports["grpc"] and ports["metrics"]["port"] == 8002  # TLS: not h2c

    policy = eventually(lambda: emulator.get(POLICY))
    assert policy["metadata"]["ownerReferences"][0]["uid"] == guarded["metadata"]["uid"]
    assert policy["spec"]["podSelector"]["matchLabels"]["embedfleet.dev/service"] == "guarded"
    serving, metrics = policy["spec"]["ingress"]
    assert serving == {"from": FRONTENDS, "ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8001, "protocol": "TCP"}]}
    assert metrics["ports"] == [{"port": 8002, "protocol": "TCP"}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NS}},
                                "podSelector": {"matchLabels": OPERATOR_LABELS}}, *PROMETHEUS]


def test_a_hand_edit_of_the_policy_is_reverted(emulator, guarded):
    eventually(lambda: emulator.get(POLICY))
    emulator.merge_patch(POLICY, {"spec": {"policyTypes": ["Ingress", "Egress"]}})
    eventually(lambda: emulator.get(POLICY)["spec"]["policyTypes"] == ["Ingress"])


def test_turning_the_policy_off_deletes_it_and_on_makes_it_again(emulator, guarded):
    eventually(lambda: emulator.get(POLICY))
    emulator.merge_patch(service_path(NS, "guarded"), {"spec": {"networkPolicy": {"enabled": False}}})
    eventually(lambda: emulator.get(POLICY) is None)
    assert emulator.get(DEPLOY) and emulator.get(SERVICE)  # the rest stays
    assert any(d[1:4] == ("networkpolicies", NS, "guarded") for d in em.deletes)
    emulator.merge_patch(service_path(NS, "guarded"), {"spec": {"networkPolicy": {"enabled": True}}})
    eventually(lambda: emulator.get(POLICY))


def test_its_calls_are_declared_for_rbac(emulator, guarded):
    eventually(lambda: emulator.get(POLICY))
    calls = em.recorded["operator"]
    assert {c for c in calls if c[1] == "networkpolicies"} >= {
        ("networking.k8s.io", "networkpolicies", v) for v in ("list", "watch", "create", "patch", "delete")}
    assert calls <= CALLS, calls - CALLS


HPA = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3}


@pytest.mark.parametrize("autoscaling, policy, warned", [
    (HPA, {"enabled": True}, True),
    (HPA, {"enabled": True, "metricsFrom": PROMETHEUS}, False),
    (HPA, {"enabled": False}, False),
    ({"mode": "operator"}, {"enabled": True}, False),  # the operator's own pods are admitted
])
def test_mode_hpa_behind_a_policy_without_metrics_from_is_warned_not_refused(autoscaling, policy, warned):
    """The HPA's metric comes from Prometheus: a policy that admits no Prometheus leaves it blind.
    Said, not refused: which peers are Prometheus no check can tell, and the spec is valid."""
    spec = specs.defaulted({"model": "m", "autoscaling": autoscaling, "networkPolicy": policy})
    assert specs.problems(spec) == []
    assert bool([w for w in specs.warnings(spec) if "metricsFrom" in w and "HorizontalPodAutoscaler" in w]) == warned


@pytest.mark.parametrize("mode", ["operator", "off"])
@pytest.mark.parametrize("policy, warned", [
    ({"enabled": True}, True),
    ({"enabled": True, "metricsFrom": PROMETHEUS}, False),
    ({"enabled": False}, False),
])
def test_a_policy_without_metrics_from_blinding_prometheus_is_warned(mode, policy, warned):
    """Modes operator and off: the operator's own scrapes get through, so nothing in its status
    shows that Prometheus (ServiceMonitor, dashboards, alerts, KEDA) reads nothing: said."""
    spec = specs.defaulted({"model": "m", "autoscaling": {"mode": mode}, "networkPolicy": policy})
    assert specs.problems(spec) == []
    assert bool([w for w in specs.warnings(spec) if "metricsFrom" in w and "Prometheus" in w]) == warned


def test_the_warning_is_a_warning_event_and_the_service_is_still_rendered(emulator, guarded):
    name = "blind-hpa"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}, "autoscaling": HPA,
        "networkPolicy": {"enabled": True}}))
    eventually(lambda: emulator.get(f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{name}"))
    eventually(lambda: emulator.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{name}"))

    def said():
        return [e for e in emulator.get(f"/api/v1/namespaces/{NS}/events")["items"]
                if e.get("involvedObject", {}).get("name") == name and e.get("reason") == "SpecWarning"]
    (event,) = eventually(said)
    assert event["type"] == "Warning" and "metricsFrom" in event["message"]
