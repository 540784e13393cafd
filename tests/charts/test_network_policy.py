"""The chart and the operator's NetworkPolicies together: the operator, given the environment the
chart gives its container (downward API resolved as the kubelet does), renders for each service a
policy whose metrics-port rule admits exactly the chart's operator pods, and whose serving rule
never admits the world; the chart's own policy selects the operator's pods; the ServiceMonitor
scrapes the port the operator's Services name `metrics`. Peers are judged with NetworkPolicy's
own semantics (`admits`): a peer's namespaceSelector AND podSelector; podSelector alone, the
policy's namespace; a rule without peers, everyone."""

import pytest

from embedop import render, render_network, spec as specs
from embedop.config import OperatorSettings
from tests.charts.test_chart import MATRIX, render as render_chart

SERVICE_NS = "search"
OWNER = render.Owner("minilm", SERVICE_NS, "0b0c7e8e-0000-4000-8000-000000000001")


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector as the API server reads it (matchLabels and matchExpressions, ANDed)."""
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def admits(peer: dict, policy_ns: str, pod_ns: str, pod_labels: dict) -> bool:
    """Whether a NetworkPolicyPeer admits a pod (namespaces carry kubernetes.io/metadata.name)."""
    if "ipBlock" in peer:  # a pod's IP is in any CIDR that wide: count it as the world
        return peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0")
    in_ns = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod_ns})
             if "namespaceSelector" in peer else pod_ns == policy_ns)
    return in_ns and selects(peer.get("podSelector") or {}, pod_labels)


def rule_admits(rule: dict, port: int, policy_ns: str, pod_ns: str, pod_labels: dict) -> bool:
    if not any(p["port"] == port for p in rule.get("ports") or [{"port": port}]):
        return False
    peers = rule.get("from")
    return not peers or any(admits(p, policy_ns, pod_ns, pod_labels) for p in peers)  # no peers: everyone


def policy_admits(policy: dict, port: int, pod_ns: str, pod_labels: dict) -> bool:
    ns = policy["metadata"]["namespace"]
    return any(rule_admits(r, port, ns, pod_ns, pod_labels) for r in policy["spec"].get("ingress") or [])


def downward(env: list[dict], namespace: str, pod_name: str) -> dict:
    """The container's environment as the kubelet resolves it (fieldRef of the pod's metadata)."""
    fields = {"metadata.namespace": namespace, "metadata.name": pod_name}
    return {e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in env}


def operator_pod(values: dict, namespace: str) -> tuple[dict, OperatorSettings]:
    (d,) = [o for o in render_chart(values, namespace) if o["kind"] == "Deployment"]
    template = d["spec"]["template"]
    (c,) = template["spec"]["containers"]
    return template["metadata"]["labels"], OperatorSettings.from_env(downward(c["env"], namespace, "ef-operator-abc"))


WORLD = [(SERVICE_NS, {"app": "search-frontend"}), ("elsewhere", {"app": "anything"}), ("kube-system", {}),
         ("embedfleet-system", {"app.kubernetes.io/name": "embedfleet-operator"})]  # the right name alone is not enough


@pytest.mark.parametrize("release_ns", ["embedfleet-system", SERVICE_NS])
@pytest.mark.parametrize("case", ["defaults", "namespaced"])
def test_a_services_policy_admits_the_charts_operator_pods_to_the_metrics_port_and_nobody_else(case, release_ns):
    labels, settings = operator_pod(MATRIX[case], release_ns)
    spec = specs.defaulted({"model": "m", "networkPolicy": {"enabled": True}})
    (policy,) = [o for o in render.companions(OWNER, spec, settings.metrics_port, render_network.OperatorPods.of(settings))
                 if o["kind"] == "NetworkPolicy"]
    (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": settings.metrics_port, "protocol": "TCP"}]]
    (peer,) = metrics_rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": release_ns}}
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy_admits(policy, settings.metrics_port, release_ns, labels)  # the operator's scrapes get through
    for ns, other in WORLD:
        if ns != release_ns or other != labels:
            assert not policy_admits(policy, settings.metrics_port, ns, other), (ns, other)
    # The serving ports: the service's own namespace by default, never the world.
    assert all(r.get("from") for r in policy["spec"]["ingress"])
    for port in (render.GRPC_PORT, render.HTTP_PORT):
        assert policy_admits(policy, port, SERVICE_NS, {"app": "search-frontend"})
        assert not policy_admits(policy, port, "elsewhere", {"app": "anything"})
        assert not policy_admits(policy, port, release_ns, labels) or release_ns == SERVICE_NS


def test_an_upgrade_keeps_the_operator_admitted():
    """Only the selector's labels are told: they stay the same across chart versions (the version
    label does not), so pods of a rollout's old and new ReplicaSets are both admitted."""
    labels, settings = operator_pod({}, "embedfleet-system")
    told = dict(settings.pod_labels)
    assert told and "app.kubernetes.io/version" in labels and "app.kubernetes.io/version" not in told
    (d,) = [o for o in render_chart({}, "embedfleet-system") if o["kind"] == "Deployment"]
    assert told == d["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("health_from", [[], [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]])
def test_the_charts_own_policy_selects_the_operator_and_opens_only_its_health_port(health_from):
    """kedaScaler off: the health port alone (the scaler's port: the next test)."""
    objects = render_chart({"networkPolicy": {"enabled": True, "healthFrom": health_from}, "kedaScaler": {"port": 0}})
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (d,) = [o for o in objects if o["kind"] == "Deployment"]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"], labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: see templates/networkpolicy.yaml
    ports = {p["containerPort"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {8080}
    assert not any(o["kind"] == "Service" for o in objects)  # no scaler Service either
    if not health_from:
        assert policy["spec"]["ingress"] == []  # nobody; the kubelet's probes come from the node
    else:
        (rule,) = policy["spec"]["ingress"]
        assert rule == {"from": health_from, "ports": [{"port": 8080, "protocol": "TCP"}]}
        assert policy_admits(policy, 8080, "monitoring", {}) and not policy_admits(policy, 8080, "elsewhere", {})
    assert not any(o["kind"] == "NetworkPolicy" for o in render_chart({}))  # off by default


def test_keda_reaches_the_leaders_scaler_and_nothing_else_of_the_operator():
    """By default the scaler is served (mode keda needs it): its Service selects the operator pod
    labelled leader (scaler.LEADER_LABEL) on the port the operator is told, which the ScaledObjects
    name; the chart's policy admits KEDA's operator pods to that port alone."""
    from embedop import scaler

    objects = render_chart({"networkPolicy": {"enabled": True}}, "embedfleet-system")
    (svc,) = [o for o in objects if o["kind"] == "Service"]
    (d,) = [o for o in objects if o["kind"] == "Deployment"]
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    container = d["spec"]["template"]["spec"]["containers"][0]
    labels, settings = operator_pod({"networkPolicy": {"enabled": True}}, "embedfleet-system")
    leader = {"matchLabels": svc["spec"]["selector"]}  # a Service's selector: labels, all of them
    assert not selects(leader, labels)  # not every operator pod: the leader
    assert selects(leader, {**labels, scaler.LEADER_LABEL: "leader"})
    (port,) = svc["spec"]["ports"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == settings.scaler_port
    assert settings.scaler_address == f"{svc['metadata']['name']}.embedfleet-system.svc:{port['port']}"
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": settings.scaler_port, "protocol": "TCP"}]
    keda = {"app.kubernetes.io/name": "keda-operator"}
    assert policy_admits(policy, settings.scaler_port, "keda", keda)
    assert not policy_admits(policy, settings.scaler_port, "keda", {}) and not policy_admits(policy, 8080, "keda", keda)


def test_the_servicemonitor_scrapes_the_port_the_operator_names_metrics():
    (monitor,) = [o for o in render_chart({"serviceMonitor": {"enabled": True}}) if o["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    svc = render.service(OWNER, specs.defaulted({"model": "m", "tls": {"secretRef": {"name": "t"}}}))
    assert selects(monitor["spec"]["selector"], svc["metadata"]["labels"])
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["port"] == OperatorSettings().metrics_port and endpoint["path"] == "/metrics"
