"""spec.auth, spec.tls and spec.networkPolicy as rendered: the Secrets mounted as kubelet keeps them
current, the probes and every scrape on the plain metrics port once a guard is on, and
a NetworkPolicy that admits the operator to that port and nobody by omission to the others.
(Strict validation against the Kubernetes schemas: test_render.py's VARIATIONS, which include
these specs.)"""

import pytest

from embedop import drift, reconcile, render, render_network, scrape, spec as specs
from embedop.config import OperatorSettings

OWNER = render.Owner("svc", "ns", "0b0c7e8e-0000-4000-8000-000000000001")
SECURED = {"model": "m", "auth": {"apiKeySecretRef": {"name": "keys"}},
           "tls": {"secretRef": {"name": "certs"}, "clientAuth": True}}
OPERATOR = render_network.OperatorPods("embedfleet-system", (("app.kubernetes.io/name", "embedfleet-operator"),
                                                             ("app.kubernetes.io/instance", "ef")))


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(deployment):
    return {e["name"]: e.get("value") for e in container(deployment)["env"]}


def secured(**extra):
    spec = specs.defaulted({**SECURED, **extra})
    assert specs.problems(spec) == []
    return spec


def test_the_secrets_are_read_only_volumes_kubelet_keeps_current():
    d = render.deployment(OWNER, secured(), "img", 1, 45)
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"] == {"secretName": "keys", "defaultMode": 0o440, "optional": False,
                                             "items": [{"key": "api-keys", "path": "api-keys"}]}
    assert volumes["tls"]["secret"] == {"secretName": "certs", "defaultMode": 0o440, "optional": False,
                                        "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]}
    mounts = {m["name"]: m for m in container(d)["volumeMounts"]}
    assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/embedfleet/auth", "readOnly": True}
    assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/embedfleet/tls", "readOnly": True}
    assert not any("subPath" in m for m in mounts.values())  # a subPath mount is never updated
    # The pod's group reads them (the server runs as uid/gid 10001; the kubelet gives them fsGroup).
    assert d["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    env = env_of(d)
    assert env["API_KEYS_FILE"] == "/etc/embedfleet/auth/api-keys"
    assert (env["TLS_CERT_FILE"], env["TLS_KEY_FILE"], env["TLS_CLIENT_CA_FILE"]) == (
        "/etc/embedfleet/tls/tls.crt", "/etc/embedfleet/tls/tls.key", "/etc/embedfleet/tls/ca.crt")


def test_a_named_key_and_tls_without_client_certificates():
    spec = secured(auth={"apiKeySecretRef": {"name": "keys", "key": "tenants"}}, tls={"secretRef": {"name": "certs"}})
    d = render.deployment(OWNER, spec, "img", 1, 45)
    env = env_of(d)
    assert env["API_KEYS_FILE"] == "/etc/embedfleet/auth/tenants" and "TLS_CLIENT_CA_FILE" not in env
    tls = next(v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert [i["key"] for i in tls["secret"]["items"]] == ["tls.crt", "tls.key"]  # a Secret without ca.crt works


def test_nothing_of_it_without_auth_and_tls():
    d = render.deployment(OWNER, specs.defaulted({"model": "m"}), "img", 1, 45)
    assert not {"API_KEYS_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE"} & env_of(d).keys()
    assert [v["name"] for v in d["spec"]["template"]["spec"]["volumes"]] == ["model-cache", "tmp"]


def test_probes_and_the_operators_scrape_use_the_plain_metrics_port_with_keys_and_tls_on():
    """The kubelet's probes and the autoscaler's scrape carry no key and speak no TLS: with both on,
    each goes to the metrics port, and it is the one the server is told to serve them on."""
    settings = OperatorSettings.from_env({"EMBEDOP_METRICS_PORT": "9102", "POD_NAMESPACE": OPERATOR.namespace,
                                          "EMBEDOP_POD_LABELS": "app.kubernetes.io/name=embedfleet-operator,"
                                                                "app.kubernetes.io/instance=ef"})
    spec = secured(networkPolicy={"enabled": True})
    body = {"metadata": {"name": OWNER.name, "namespace": OWNER.namespace, "uid": OWNER.uid}, "spec": spec}
    d, _ = reconcile.deployment_for(settings, body, spec, None)
    c = container(d)
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    assert port == 9102 and env_of(d)["METRICS_PORT"] == "9102"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 9102}, probe
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9102"
    (scraped,) = scrape.ports(spec, settings.metrics_port)  # autoscaler.step scrapes this port alone
    assert scrape.metrics_url("10.1.2.3", scraped) == "http://10.1.2.3:9102/metrics"
    companions = render.companions(OWNER, spec, settings.metrics_port, render_network.OperatorPods.of(settings))
    for svc in (o for o in companions if o["kind"] == "Service"):
        assert {"name": "metrics", "port": 9102, "targetPort": 9102, "protocol": "TCP"} in svc["spec"]["ports"]
    (policy,) = [o for o in companions if o["kind"] == "NetworkPolicy"]
    (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 9102, "protocol": "TCP"}]]
    assert metrics_rule["from"] == [OPERATOR.peer()]


@pytest.mark.parametrize("tls, app_protocol", [(None, "kubernetes.io/h2c"), ({"secretRef": {"name": "c"}}, None)])
def test_the_grpc_ports_app_protocol_says_h2c_only_without_tls(tls, app_protocol):
    spec = specs.defaulted({"model": "m", **({"tls": tls} if tls else {})})
    for svc in (render.service(OWNER, spec), render.headless_service(OWNER, spec)):
        grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc.get("appProtocol") == app_protocol


def policy_of(np_spec, operator=OPERATOR):
    spec = specs.defaulted({"model": "m", "networkPolicy": np_spec})
    assert specs.problems(spec) == []
    objects = render.companions(OWNER, spec, render.METRICS_PORT, operator)
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def rule_for(policy, port):
    return next((r for r in policy["spec"]["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"]), None)


def test_the_policy_selects_the_services_pods_and_admits_its_own_namespace_by_default():
    (policy,) = policy_of({"enabled": True})
    assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid and policy["metadata"]["name"] == "svc"
    assert policy["spec"]["podSelector"] == {"matchLabels": render.selector("svc")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (model downloads, traces) left open
    serving = rule_for(policy, render.GRPC_PORT)
    assert serving is rule_for(policy, render.HTTP_PORT)
    # Pods of the policy's own namespace only: a rule without peers would admit the world.
    assert serving["from"] == [{"podSelector": {}}]
    assert rule_for(policy, render.METRICS_PORT)["from"] == [OPERATOR.peer()]


def test_the_peers_given_replace_the_default_and_prometheus_joins_the_operator():
    frontends = [{"podSelector": {"matchLabels": {"app": "search-frontend"}}}]
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (policy,) = policy_of({"enabled": True, "from": frontends, "metricsFrom": prometheus})
    assert rule_for(policy, render.GRPC_PORT)["from"] == frontends
    assert rule_for(policy, render.METRICS_PORT)["from"] == [OPERATOR.peer(), *prometheus]
    assert {"port": render.METRICS_PORT, "protocol": "TCP"} not in rule_for(policy, render.GRPC_PORT)["ports"]


def test_the_operator_peer_is_its_namespace_and_its_labels_together():
    """One peer with both selectors: as two peers, every pod of the namespace and every pod
    anywhere with the labels would be admitted."""
    assert OPERATOR.peer() == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "embedfleet-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "embedfleet-operator",
                                        "app.kubernetes.io/instance": "ef"}}}


@pytest.mark.parametrize("operator", [None, render_network.OperatorPods("", OPERATOR.labels),
                                      render_network.OperatorPods("ops", ())])
def test_a_port_nobody_is_named_for_stays_closed(operator):
    """The operator's pods unknown (outside the cluster) and no metricsFrom: no rule for the
    metrics port, which is then closed (an empty `from` would open it to everyone)."""
    (policy,) = policy_of({"enabled": True}, operator)
    assert rule_for(policy, render.METRICS_PORT) is None
    assert all(r["from"] for r in policy["spec"]["ingress"])


def test_no_policy_unless_enabled():
    assert policy_of({"enabled": False, "from": [{"podSelector": {}}]}) == []
    assert not [o for o in render.companions(OWNER, specs.defaulted({"model": "m"})) if o["kind"] == "NetworkPolicy"]
    assert "NetworkPolicy" in render.OPTIONAL_KINDS  # so the reconcile deletes one rendered before


def test_a_stored_policy_without_its_empty_lists_is_not_drift():
    """The API server omits an empty list (a peer's matchExpressions: []): what it stores must not
    read as drift at every check."""
    peer = {"podSelector": {"matchLabels": {"app": "a"}, "matchExpressions": []}}
    (policy,) = policy_of({"enabled": True, "from": [peer]})
    desired = drift.stamped(policy)
    stored = drift.stamped(policy)
    stored["spec"]["ingress"][0]["from"] = [{"podSelector": {"matchLabels": {"app": "a"}}}]
    assert not drift.drifted(desired, stored)
